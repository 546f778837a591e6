"""Partial rollouts with in-flight weight updates (decoupled mode, `rollout.partial`).

The decoupled sampler keeps up to twice a step's prompt groups in flight on its engine. A
step's batch is the first `data.batch_size` groups to finish, so a few long generations do
not hold up the batch; the others keep decoding into later batches, and when the trainer
publishes new weights they continue on them between two engine calls (with the KV cache they
have), instead of being thrown away. Each token records the version of the weights that
decoded it; the loss's off-policy correction (`loss.correction`) reweights or drops tokens
whose sampler differs from the trainer's old policy.

Admission control keeps every token within `rollout.max_staleness` of the step that trains
on it: batch `i` is only decoded with weights of version >= i - 1 - max_staleness; a group
whose oldest token would be too stale for the next batch is finished and taken into this
one (oldest groups first); and a group only starts on a version if the untaken groups as old
fit the batches that can still take them, so those that must be taken always fit. Nothing
that was sampled is discarded (a resumed run starts with nothing in flight: the prompts that
were are not drawn again).

On several processes every process keeps the whole bookkeeping (every group, in flight or
finished) and makes every decision above; group k (in submission order) is decoded and scored
by process k mod P on its own sampler devices. After each engine call the processes tell each
other which of their groups ended (through the host), so they all see the same groups finish
at the same call, and the groups a batch takes cross with their completions and rewards
(`gather_groups`). A group's tokens do not depend on which engine decodes it (its key is its
submission index; every engine call advances each row by the same chunk), so the batches are
those of one process; with `rollout.newest_weights=False` the weights of every call are too,
and the run is reproducible on any number of processes.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import jax
import numpy as np

from posttrain.models import Transformer
from posttrain.parallel import exchange
from posttrain.rewards import component_means
from posttrain.rl._rollout import add_tallies_of_every_process
from posttrain.rl._rollout_producer import RolloutProducer, Stopped
from posttrain.rl._shares import gather_groups
from posttrain.sampling import Request, request_completions


@dataclasses.dataclass
class _Group:
    prompt: dict
    index: int  # submitted as the index-th group (its sampling seed)
    request: Request | None  # None: another process decodes it
    first_version: int  # the weights' version when it was submitted (<= its first token's)
    completions: list | None = None  # (on the process that decoded it, until it is taken)
    rewards: np.ndarray | None = None


class PartialProducer(RolloutProducer):
    """`RolloutProducer` whose batches are made of the groups that finish first, with the
    rest continuing on newer weights (see the module docstring)."""

    def __init__(self, c, prompts, rollouts, side, start: int):
        super().__init__(c, prompts, rollouts, side, start)
        self.in_flight: list[_Group] = []
        self.finished: list[_Group] = []
        self.waiting: list[dict] = []  # prompts drawn, not yet submitted
        self.submitted = 0  # groups submitted so far (their sampling seeds)
        self.engine = None
        self._prepared_version = None

    def _run(self, first: int) -> None:
        try:
            for i in itertools.count(first):
                taken, counts = self._batch(i)
                kept = [g.prompt for g in taken]
                completions = [g.completions for g in taken]
                rewards = np.asarray([g.rewards for g in taken], np.float32)
                version = min(v for g in completions for c in g for v in c.versions or (i - 1,))
                state = self.prompts.get_state()
                self.ready.put((i, version, kept, completions, rewards, counts, state))
        except Stopped:
            return
        except BaseException as e:  # reported to the trainer by get()
            self.error = e
            self.ready.put(None)

    def get(self, step: int):
        kept, completions, rewards, counts, state = super().get(step)
        versions = np.asarray([v for g in completions for c in g for v in c.versions])
        staleness = step - 1 - versions
        counts = {
            **counts,
            "token_staleness_mean": float(staleness.mean()) if versions.size else 0.0,
            "token_staleness_max": float(staleness.max(initial=0)),
            # groups whose tokens came from more than one version of the weights
            "groups_spanning_versions": float(
                sum(len({v for c in g for v in c.versions}) > 1 for g in completions)
            ),
        }
        return kept, completions, rewards, counts, state

    def _engine_on(self, i: int, label: str) -> int:
        """Waits for the weights batch i may decode with (`_weights`); swaps them into the
        engine. Of fixed versions (`rollout.newest_weights=False`) the batch takes the one
        after the oldest it may take (i - max_staleness, at most i - 1): a group started on
        the oldest would be too stale for the next batch, so none could continue into it."""
        r = self.c.rollout
        bound = i - 1 - r.max_staleness
        weights, version = self._weights(bound, label, fixed=min(i - 1, bound + 1))
        if version != self._prepared_version:
            model = Transformer(self.side.prepare(weights), self.rollouts.model_config)
            self.engine = self.rollouts.engine_for(model)
            self.engine.set_eos(self.rollouts.tokenizer.eos_ids)
            self.engine.version, self._prepared_version = version, version
        return version

    def _submit(self, i: int, version: int) -> None:
        """Starts groups while fewer than two batches' worth are in flight or waiting to be
        taken, and while the untaken groups as old as this version fit the batches that may
        still take them: a group started on version v must be in a batch <= v + 1 +
        max_staleness, and batches i .. v + 1 + max_staleness hold that many batches' worth."""
        c, r = self.c, self.c.rollout
        groups = c.data.batch_size
        room = (version + 2 + r.max_staleness - i) * groups
        while len(self.in_flight) + len(self.finished) < 2 * groups and room > sum(
            g.first_version <= version for g in self.in_flight + self.finished
        ):
            if not self.waiting:
                self.waiting = list(next(self.prompts))
            prompt = self.waiting.pop(0)
            index, request = self.submitted, None
            if index % jax.process_count() == jax.process_index():  # (else another's)
                seed = np.random.SeedSequence([c.train.seed, index]).generate_state(1)[0]
                request = Request(
                    prompt=list(prompt["prompt_ids"]),
                    max_new_tokens=r.max_new_tokens,
                    key=jax.random.key(int(seed)),
                    n=r.num_generations,
                    sampling=r.sampling,
                )
                self.engine.submit(request)
            self.in_flight.append(_Group(prompt, index, request, version))
            self.submitted += 1

    def _batch(self, i: int) -> tuple[list[_Group], dict]:
        """Batch i: decodes until a batch's worth of groups has finished and none that would
        be too stale for batch i + 1 is still running; takes the oldest."""
        groups, bound = self.c.data.batch_size, i - 1 - self.c.rollout.max_staleness
        timings = {"generate_s": 0.0, "reward_s": 0.0}
        for call in itertools.count():
            label = f"batch {i} call {call}"
            version = self._engine_on(i, label)
            self._submit(i, version)
            # (a group started on version <= bound would be too stale for batch i + 1)
            expiring = any(g.first_version <= bound for g in self.in_flight)
            if len(self.finished) >= groups and not expiring:
                break
            if not self.in_flight:  # (cannot happen: an empty engine always has room)
                raise RuntimeError("partial rollouts: no group in flight and too few finished")
            start = time.perf_counter()
            done = {id(req) for req in self.engine.step()}
            generated = time.perf_counter()
            mine = [g for g in self.in_flight if g.request is not None and id(g.request) in done]
            for g in mine:
                g.completions = request_completions(self.rollouts.tokenizer, self.engine, g.request)
            if mine:
                rewards = self.rollouts.score(
                    [g.prompt for g in mine], [g.completions for g in mine], timings=timings
                )
                for g, r in zip(mine, rewards, strict=True):
                    g.rewards = r
            ended = {g.index for g in mine}
            if jax.process_count() > 1:  # (every process's groups that ended in this call)
                local = {"ended": np.asarray(sorted(ended), np.int64)}
                theirs = exchange(self.rollouts.channel, f"{label}: ended", local)
                ended = {int(k) for t in theirs for k in t["ended"]}
            self.finished += [g for g in self.in_flight if g.index in ended]
            self.in_flight = [g for g in self.in_flight if g.index not in ended]
            timings["generate_s"] += generated - start
            timings["reward_s"] += time.perf_counter() - generated
        self.finished.sort(key=lambda g: g.first_version)  # (stable: first submitted first)
        taken, self.finished = self.finished[:groups], self.finished[groups:]
        if any(g.first_version <= bound for g in self.finished):
            raise RuntimeError("partial rollouts: more groups are due than a batch holds")
        if jax.process_count() > 1:
            self._gather(taken, timings, f"batch {i}")
        counts = {
            "prompts_drawn": float(len(taken)),
            "groups_dropped": 0.0,
            "groups_in_flight": float(len(self.in_flight)),
            **component_means(timings),
        }
        return taken, counts

    def _gather(self, taken: list[_Group], timings: dict, label: str) -> None:
        """On several processes: every taken group's completions and rewards from the process
        that decoded it, the reward tallies summed over the processes, and each process's mean
        completion length (`response_length/process<p>`)."""
        G, P = self.c.rollout.num_generations, jax.process_count()
        mine = [g for g in taken if g.request is not None]
        completions, rewards = gather_groups(
            [g.completions for g in mine],
            np.asarray([g.rewards for g in mine], np.float32).reshape(len(mine), G),
            len(taken),
            G,
            channel=self.rollouts.channel,
            label=f"{label}: {len(taken)} groups",
        )
        # (gathered in process order: process p's are the taken groups k with k mod P = p)
        order = [g for p in range(P) for g in taken if g.index % P == p]
        for g, got, r in zip(order, completions, rewards, strict=True):
            g.completions, g.rewards = got, r
        add_tallies_of_every_process(timings, {}, self.rollouts.channel, label)
        for p in range(P):
            lengths = [len(c.token_ids) for g in taken if g.index % P == p for c in g.completions]
            timings[f"response_length/process{p}"] = float(sum(lengths))
            timings[f"n:response_length/process{p}"] = len(lengths)
