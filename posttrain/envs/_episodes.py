"""Multi-turn episodes on the generation engine, token in / token out.

Each episode is one token sequence: the prompt (the environment's opening messages rendered
with its tools), then per turn the tokens the engine sampled (loss mask 1, with their
log-probs) and the tokens of the environment's answer (loss mask 0), rendered as the
difference the new messages make (`posttrain.data.Turns`), never by re-rendering earlier turns.
What the trainer scores is exactly what the sampler drew.

Episodes share the engine: every turn is a request, so while an episode's tools run (on the
`ElasticPool`), its row serves other episodes, and a finished episode frees its slot at once.
The G episodes of a prompt (a GRPO group) start as one request with n=G, sharing the prompt's
prefill and blocks; later turns are requests of their own. An episode's KV blocks outlive its
turns (`Request.keep`): the next turn continues on them (`Request.cached`) and prefills only
the observation's tokens (after speculative rounds also the last sampled one, whose keys a
round leaves unwritten), where the engine can keep blocks (`Engine.keeps_kv`; else each turn
prefills the episode's tokens so far).

Sampling keys: episode j of group g draws turn 0 with `fold_in(key_g, j)` inside the group's
request and turn t > 0 with `fold_in(fold_in(fold_in(key_g, t), j), 0)`, so an episode's tokens
depend on its seed and what the environment answered, not on scheduling.

Budgets end an episode early, as truncated: `max_turns`, `max_tokens` (sampled and
observation tokens after the prompt) and `max_tool_s` (seconds its tools ran). A turn that
reaches `turn_tokens` without ending is cut: the environment still answers it, and the
observation's tokens start with the end-of-turn token the model did not sample.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.config import ConfigError
from posttrain.data import Turns, parse_tool_calls, tool_format_for
from posttrain.envs._base import Environment, Step
from posttrain.envs._episode import Budget, Episode
from posttrain.envs._pool import ElasticPool
from posttrain.parallel import tracing
from posttrain.sampling import Engine, Request, SamplingParams

_log = logging.getLogger(__name__)

# Seconds an environment call may run past the episode's tool time before the episode stops
# waiting for it (an environment that stops its own calls returns well within).
_GRACE_S = 10.0


@dataclasses.dataclass(frozen=True)
class Shared:
    """Episodes on several processes that run one engine (a sampler spanning them): each
    process runs the environment calls of the episodes it owns (`mine(group, index)`), and
    `exchange(events) -> [every process's events]` tells every process what the environments
    answered, so all feed the engine the same requests at the same calls."""

    mine: Callable[[int, int], bool]
    exchange: Callable[[list], list[list]]


@dataclasses.dataclass
class _Live:
    """An episode in progress."""

    env: Environment
    turns: Turns | None = None
    episode: Episode | None = None
    erred: bool = False  # a tool error not yet followed by a success
    ended: bool = True  # the last turn ended with an end-of-turn token (not cut)
    kept: Any = None  # the KV blocks of its tokens so far (`Request.keep`), for its next turn


def run_episodes(
    engine: Engine,
    tokenizer,
    groups: Sequence[Sequence[Environment]],
    *,
    keys: jax.Array,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    budget: Budget = Budget(),  # noqa: B008 (a frozen record)
    pool: ElasticPool | None = None,
    tool_format: str = "auto",
    on_episode: Callable[[Episode], None] | None = None,
    keep_kv: bool = True,
    shared: Shared | None = None,
) -> list[list[Episode]]:
    """Runs every environment's episode to its end; returns the episodes by group.

    Args:
      engine: the engine to sample on (its model holds the weights to use; its `max_len`
        must hold the longest prompt plus `budget.max_tokens`).
      tokenizer: the model's tokenizer (its chat template renders messages and tools).
      groups: environments, grouped by prompt (the episodes of one GRPO group).
      keys: one PRNG key per group (`[len(groups)]` typed keys, or their key data).
      temperature, top_p, top_k: sampling settings of every turn.
      budget: per-episode limits.
      pool: where environment calls run (resets, steps, closes); default: a pool of 1..8.
      tool_format: how tool calls are parsed from the model's text ("hermes", "llama3_json",
        "mistral", ...); "auto" guesses from the chat template.
      on_episode: called with each episode as it finishes.
      keep_kv: an episode's next turn continues on the KV blocks of its earlier ones
        (prefilling only what the environment answered) where the engine can keep them;
        False prefills its whole history every turn.
      shared: several processes running this engine together (`Shared`): every process
        calls this with the same groups; each runs its own episodes' environments, and after
        each engine call the answers that arrived on any process are applied on all, in one
        order.

    Returns:
      Per group, its episodes in the order of its environments.
    """
    if tool_format == "auto":
        tool_format = tool_format_for(tokenizer.chat_template or "")
    own_pool = pool is None
    pool = pool or ElasticPool(1, 8)
    engine.set_eos(tokenizer.eos_ids)
    sampling = SamplingParams(temperature, top_p, top_k)
    keep = keep_kv and engine.keeps_kv()
    # Every key a turn can take, on the host (one device call): the episode loop then queues
    # no device program of its own between the engine's (on several processes or devices,
    # programs queued by the row's progress could stall a device's queue; docs/multihost.md).
    first, own, turn = _turn_keys(keys, max(map(len, groups), default=1), budget.max_turns)
    live = [[_Live(env) for env in group] for group in groups]
    out: list[list[Episode | None]] = [[None] * len(g) for g in groups]
    waiting: dict[Future, tuple[str, int, int]] = {}  # env calls: (kind, group, index)
    deadlines: dict[Future, float] = {}  # env calls: when the episode stops waiting
    running: dict[int, tuple[Request, int, list[int]]] = {}  # request id -> (request, g, [j])
    taken: dict[int, set[int]] = {}  # request id -> episodes whose turn was collected
    opened = [0] * len(groups)
    left = sum(map(len, groups))

    mine = (lambda g, j: True) if shared is None else shared.mine

    def finish(g: int, j: int, reason: str, reward: float | None = None) -> None:
        nonlocal left
        item = live[g][j]
        ep = item.episode
        ep.finish_reason, ep.reward = reason, reward if reason != "error" else 0.0
        engine.release(item.kept)
        item.kept = None
        if mine(g, j):
            call("close", g, j, item.env.close)
        out[g][j] = ep
        left -= 1
        if on_episode is not None:
            on_episode(ep)

    def call(kind: str, g: int, j: int, fn, *args) -> None:
        """Runs an environment call on the pool, waited for until the episode's tool time
        left (plus a grace of `_GRACE_S`, or the tool time if less): a tool that never returns
        cannot hold the rollout."""
        left_s = budget.max_tool_s - (live[g][j].episode.tool_s if kind == "step" else 0.0)
        left_s += min(_GRACE_S, budget.max_tool_s)
        future = pool.submit(tracing.in_context(_traced(f"env.{kind}", fn, group=g, sample=j)),
                             *args)  # fmt: skip
        waiting[future], deadlines[future] = (kind, g, j), time.monotonic() + left_s

    def overdue(future: Future) -> None:
        """Stops waiting for a call past its deadline (its thread is left to it)."""
        kind, g, j = waiting.pop(future)
        del deadlines[future]
        if kind == "reset":
            raise RuntimeError(
                f"an environment's reset ran past env.max_tool_s ({budget.max_tool_s:g} s) and a "
                "grace: check the environment"
            )
        _log.warning("an environment %s ran past the episode's tool time (%g s); it is left "
                     "running%s", kind, budget.max_tool_s,
                     "" if kind == "close" else " and the episode ends as tool_time")  # fmt: skip
        if kind == "step":
            live[g][j].episode.tool_s = budget.max_tool_s
            finish(g, j, "tool_time")

    def submit_turn(g: int, js: list[int], key) -> None:
        ep = live[g][js[0]].episode
        prompt = ep.prompt_ids + ep.token_ids
        room = min(budget.turn_tokens, budget.max_tokens - len(ep.token_ids))
        room = min(room, engine.max_len - len(prompt))
        if room < 1:
            for j in js:
                finish(g, j, "length")
            return
        cached = live[g][js[0]].kept if len(js) == 1 else None
        live[g][js[0]].kept = None  # (the request's now)
        req = Request(prompt=prompt, max_new_tokens=room, key=key, n=len(js), sampling=sampling,
                      keep=keep, cached=cached)  # fmt: skip
        running[id(engine.submit(req))] = (req, g, js)
        taken[id(req)] = set()

    def on_sampled(g: int, j: int, tokens: list[int], logps: list[float], ended: bool) -> None:
        item = live[g][j]
        ep = item.episode
        ep.token_ids += tokens
        ep.logprobs += logps
        ep.mask += [1] * len(tokens)
        ep.turns += 1
        body = tokens[:-1] if ended else tokens
        parsed = parse_tool_calls(tokenizer.decode(body, skip_special_tokens=False), tool_format)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        ep.messages.append(message)
        ep.text = parsed.content
        item.ended = ended
        if not ended and len(ep.token_ids) >= budget.max_tokens:
            finish(g, j, "length")
            return
        # (A turn cut by turn_tokens still goes to the environment; its observation closes it.)
        step_message = {**message, "tool_call_errors": list(parsed.errors)}
        if mine(g, j):  # (shared: another process's episode; its answer comes as an event)
            call("step", g, j, item.env.step, step_message)

    def on_step(g: int, j: int, step: Step) -> None:
        item = live[g][j]
        ep, info = item.episode, step.info or {}
        calls, errors = int(info.get("tool_calls", 0)), int(info.get("tool_errors", 0))
        ep.tool_calls += calls
        ep.tool_errors += errors
        ep.tool_s += float(info.get("tool_s", 0.0))
        if "turn_reward" in info:
            ep.turn_rewards.append(float(info["turn_reward"]))
        for name, value in info.items():  # the environment's own numbers
            if name not in _COUNTED and isinstance(value, int | float):
                ep.counts[name] = ep.counts.get(name, 0.0) + float(value)
        if item.erred and (step.done or calls > errors):
            ep.recovered, item.erred = True, False
        item.erred = item.erred or errors > 0
        if step.done:
            finish(g, j, "stop", step.reward)
            return
        if ep.turns >= budget.max_turns:
            finish(g, j, "turns")
            return
        if ep.tool_s > budget.max_tool_s:
            finish(g, j, "tool_time")
            return
        observed = item.turns.observation(ep.messages, step.observations, ended=item.ended)
        ep.messages += step.observations
        if len(ep.token_ids) + len(observed) >= budget.max_tokens:
            finish(g, j, "length")
            return
        ep.token_ids += observed
        ep.logprobs += [0.0] * len(observed)
        ep.mask += [0] * len(observed)
        submit_turn(g, [j], turn[g, ep.turns, j])

    def collect() -> None:
        """After an engine call: each sample whose turn is over (as soon as it is done, not
        when its whole group is) goes to its environment."""
        for rid, (req, g, js) in list(running.items()):
            for s, j in enumerate(js):
                if req.done[s] and j not in taken[rid]:
                    taken[rid].add(j)
                    live[g][j].kept = req.kept[s]
                    hit = engine.hit_eos(req, s)
                    on_sampled(g, j, req.tokens[s], req.logprobs[s], hit)
            if len(taken[rid]) == len(js):
                del running[rid], taken[rid]

    def on_reset(g: int, j: int, messages: list[dict]) -> None:
        item = live[g][j]
        item.turns = Turns(tokenizer, item.env.schemas)
        prompt = item.turns.prompt(messages)
        if len(prompt) + budget.max_tokens > engine.max_len:
            raise ConfigError(
                f"an episode's prompt has {len(prompt)} tokens with its tools rendered; with "
                f"{budget.max_tokens} tokens of episode that exceeds the engine's max_len="
                f"{engine.max_len}: raise rollout.max_prompt_len (RL) or the engine's max_len"
            )
        item.episode = Episode(
            record=dict(item.env.record),
            prompt_ids=prompt,
            messages=list(messages),
            tools=item.env.schemas,
        )
        opened[g] += 1
        if opened[g] < len(live[g]):
            return
        # The whole group is open: one request when its prompts agree (shared prefill).
        prompts = [x.episode.prompt_ids for x in live[g]]
        if all(p == prompts[0] for p in prompts):
            submit_turn(g, list(range(len(prompts))), first[g])
        else:
            for k in range(len(prompts)):
                submit_turn(g, [k], own[g, k])

    def apply(event: dict) -> None:
        """An environment's answer that arrived on some process (`shared`), applied."""
        kind, g, j = event["kind"], event["g"], event["j"]
        if kind == "reset":
            on_reset(g, j, event["result"])
        elif kind == "step":
            on_step(g, j, Step(**event["result"]))
        elif kind == "step_error":
            _log.warning("an environment step raised (episode ends, reward 0): %s",
                         event["result"])  # fmt: skip
            finish(g, j, "error")
        elif kind == "step_overdue":
            _log.warning(
                "an environment step ran past the episode's tool time (%g s); it is left "
                "running and the episode ends as tool_time",
                budget.max_tool_s,
            )
            live[g][j].episode.tool_s = budget.max_tool_s
            finish(g, j, "tool_time")
        else:  # a reset that raised or never returned stops the rollout on every process
            why = event["result"] or f"it ran past env.max_tool_s ({budget.max_tool_s:g} s)"
            raise RuntimeError(f"the reset of episode {j} of group {g} failed: {why}")

    def shared_round() -> None:
        """`shared`: this process's environment answers so far, everyone's applied."""
        events, now = [], time.monotonic()
        for future in list(waiting):
            kind, g, j = waiting[future]
            if not future.done() and deadlines[future] >= now:
                continue
            del waiting[future], deadlines[future]
            if kind == "close":
                if future.done() and future.exception() is not None:
                    _log.warning("closing an environment failed: %s", future.exception())
                continue
            if not future.done():
                events.append({"kind": f"{kind}_overdue", "g": g, "j": j, "result": None})
            elif (error := future.exception()) is not None:
                events.append({"kind": f"{kind}_error", "g": g, "j": j, "result": repr(error)})
            else:
                result = future.result()
                result = result._asdict() if kind == "step" else result
                events.append({"kind": kind, "g": g, "j": j, "result": result})
        everyone = [e for theirs in shared.exchange(events) for e in theirs]
        for event in sorted(everyone, key=lambda e: (e["g"], e["j"])):
            apply(event)

    for g, group in enumerate(live):
        for j, item in enumerate(group):
            if mine(g, j):
                call("reset", g, j, item.env.reset)
    try:
        while shared is not None and left:  # (the same rounds on every process)
            if not engine.idle:
                engine.step()
                collect()
            else:  # wait for one of this process's calls (or none: the others answer)
                calls = [f for f, (kind, _, _) in waiting.items() if kind != "close"]
                if calls:
                    soonest = min(deadlines[f] for f in calls) - time.monotonic()
                    wait(calls, timeout=max(soonest, 0.0), return_when=FIRST_COMPLETED)
            shared_round()
        if shared is not None:  # (this process's closes)
            wait(list(waiting), timeout=budget.max_tool_s + _GRACE_S)
            waiting.clear()
        while left or waiting:
            for future in [f for f in waiting if f.done()]:
                kind, g, j = waiting.pop(future)
                del deadlines[future]
                try:
                    result = future.result()
                except Exception as e:
                    if kind == "close":
                        _log.warning("closing an environment failed: %s", e)
                        continue
                    if kind == "reset":
                        raise
                    _log.warning("an environment step raised (episode ends, reward 0): %r", e)
                    finish(g, j, "error")
                    continue
                if kind == "reset":
                    on_reset(g, j, result)
                elif kind == "step":
                    on_step(g, j, result)
            if not engine.idle:
                engine.step()
                collect()
            elif waiting:
                soonest = min(deadlines.values()) - time.monotonic()
                wait(list(waiting), timeout=max(soonest, 0.0), return_when=FIRST_COMPLETED)
            elif left:
                raise RuntimeError(f"{left} episodes neither run nor wait (a bug)")
            now = time.monotonic()
            for future in [f for f, t in deadlines.items() if t < now and not f.done()]:
                overdue(future)
    finally:
        if own_pool:
            pool.close()
        if not engine.idle:  # (an error above: leave the engine empty for its next user)
            for req, _, _ in list(running.values()):
                engine.cancel(req)
        for rid, (req, _, js) in running.items():  # samples done but not collected
            for s, j in enumerate(js):
                if j not in taken.get(rid, ()):
                    engine.release(req.kept[s])
        for item in (x for group in live for x in group):
            engine.release(item.kept)
            item.kept = None
    return out


@functools.partial(jax.jit, static_argnums=(1, 2))
def _turn_key_table(key_data, size: int, turns: int):
    keys = jax.random.wrap_key_data(key_data)
    fold = jax.vmap(jax.random.fold_in, (None, 0))  # one key, many data
    own = jax.vmap(lambda k: fold(k, (1 << 20) | jnp.arange(size)))(keys)
    turn = jax.vmap(
        lambda k: jax.vmap(lambda t: fold(jax.random.fold_in(k, t), jnp.arange(size)))(
            jnp.arange(turns + 1)
        )
    )(keys)
    return tuple(jax.random.key_data(k) for k in (keys, own, turn))


def _turn_keys(keys, size: int, turns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The key data (host) of each group's turns: `first[g]` (a group's first turn, its
    samples `fold_in(key, j)` in the engine), `own[g, k]` (episode k's first turn when the
    group's prompts differ: `fold_in(key, 2^20 | k)`) and `turn[g, t, j]` (episode j's turn
    after t sampled turns: `fold_in(fold_in(key, t), j)`)."""
    if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        keys = jax.random.key_data(keys)
    data = np.asarray(jax.device_get(keys))  # (host data: placed by the jit's context)
    return tuple(np.asarray(a) for a in jax.device_get(_turn_key_table(data, size, turns)))


_COUNTED = ("tool_calls", "tool_errors", "tool_s", "turn_reward")  # (an Episode's own fields)


def _traced(name: str, fn, **attributes):
    """`fn` run inside a span (`posttrain.parallel.tracing`; `fn` itself when tracing is off)."""
    if not tracing.enabled():
        return fn

    def run(*args):
        with tracing.span(name, **attributes):
            return fn(*args)

    return run
