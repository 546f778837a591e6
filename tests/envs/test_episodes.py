"""Multi-turn episodes on the engine: token in / token out (the trainer scores exactly what the
sampler drew; observation tokens carry no loss), budgets, tool errors and their metrics."""

import os
import threading

import jax
import numpy as np
import pytest

from posttrain.data import load_tokenizer
from posttrain.data._turns import Turns
from posttrain.demo._calculator import build_calculator_assets, solved_episode
from posttrain.envs import (
    Budget,
    ElasticPool,
    Environment,
    Step,
    calculate,
    episode_metrics,
    make_env,
    run_episodes,
)
from posttrain.models import Transformer, get_preset
from posttrain.sampling import Engine, EngineConfig
from tests.envs.conftest import assert_trained_as_sampled

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_calculator_assets(tmp_path_factory.mktemp("calc"), n_train=8, n_eval=4, n_sft=4)


@pytest.fixture(scope="module")
def tokenizer(assets):
    return load_tokenizer(assets["tokenizer"])


@pytest.fixture(scope="module")
def model():
    return Transformer.init(get_preset("tiny", attention="xla"), 0)


class Chatty(Environment):
    """Never ends on its own: answers every turn with a user message."""

    def reset(self):
        return [{"role": "user", "content": self.record["prompt"]}]

    def step(self, message):
        turn = getattr(self, "turn", 0) + 1
        self.turn = turn
        # (an environment's own numbers: summed per episode, averaged as episode/pokes; one
        # named like the loop's own metric does not replace it)
        info = {"pokes": 2, "turns": 99}
        return Step([{"role": "user", "content": f"go on {turn}"}], None, False, info)


def test_four_turn_episode_is_scored_as_sampled(model, tokenizer):
    engine = Engine(model, EngineConfig(slots=4, chunk=4), max_len=256)
    records = [{"prompt": "What is 12 * 34?"}, {"prompt": "Hello there"}]
    groups = [[Chatty(r), Chatty(r)] for r in records]
    budget = Budget(max_turns=4, max_tokens=200, turn_tokens=8)
    keys = jax.random.split(jax.random.key(0), 2)
    episodes = run_episodes(
        engine, tokenizer, groups, keys=keys, temperature=1.0, budget=budget, pool=ElasticPool(0, 2)
    )
    flat = [ep for group in episodes for ep in group]
    assert [ep.turns for ep in flat] == [4, 4, 4, 4]
    assert all(ep.finish_reason == "turns" and ep.truncated for ep in flat)
    # The environment answered 4 turns (the 4th's answer is dropped: no 5th turn).
    assert [ep.counts for ep in flat] == [{"pokes": 8.0, "turns": 396.0}] * 4
    metrics = episode_metrics(flat)
    assert metrics["episode/pokes"] == 8.0 and metrics["episode/turns"] == 4.0
    # Observations are the rendered difference: their text is in the episode, mask 0.
    for ep in flat:
        observed = [t for t, m in zip(ep.token_ids, ep.mask, strict=True) if not m]
        text = tokenizer.decode(observed, skip_special_tokens=False)
        for turn in (1, 2, 3):
            assert f"<|im_start|>user\ngo on {turn}<|im_end|>\n<|im_start|>assistant\n" in text
        assert sum(ep.mask) == sum(1 for lp in ep.logprobs if lp != 0.0)
    assert_trained_as_sampled(model, flat, max_len=256, pad_id=tokenizer.pad_id or 0)


def test_an_episodes_next_turn_prefills_only_what_the_environment_answered(model, tokenizer):
    """With its KV blocks kept between turns an episode's turn 2+ prefills the observation's
    tokens (the last sampled token is in the cache already) instead of its whole history: the
    same episodes, token for token and log-prob for log-prob, as re-prefilling every turn,
    each prompt prefilled once, and every block given back at the end."""
    records = [{"prompt": "What is 12 * 34?"}, {"prompt": "Hello there"}]
    budget = Budget(max_turns=4, max_tokens=200, turn_tokens=8)
    runs = {}
    for keep in (True, False):
        engine = Engine(model, EngineConfig(slots=3, chunk=4), max_len=256)  # 3 rows for 4
        groups = [[Chatty(r), Chatty(r)] for r in records]
        episodes = run_episodes(
            engine, tokenizer, groups, keys=jax.random.split(jax.random.key(0), 2),
            temperature=1.0, budget=budget, pool=ElasticPool(0, 2), keep_kv=keep,
        )  # fmt: skip
        runs[keep] = [ep for group in episodes for ep in group], engine.stats
        assert engine.blocks_in_use == 0
    (kept, warm), (plain, cold) = runs[True], runs[False]
    assert [ep.token_ids for ep in kept] == [ep.token_ids for ep in plain]
    for a, b in zip(kept, plain, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    observed = sum(len(ep.mask) - sum(ep.mask) for ep in kept)
    prompts = sum(len(ep.prompt_ids) for ep in kept[::2])  # one per group
    # (+1: the episode that waited for a row passes its prompt's last token, for the logits)
    assert warm.prefill_tokens == prompts + observed + 1, warm
    assert cold.prefill_tokens > 2 * warm.prefill_tokens, (cold, warm)


class Stuck(Chatty):
    """A tool that never returns (until the test lets it go)."""

    release = threading.Event()

    def step(self, message):
        self.release.wait()
        return super().step(message)


def test_a_tool_that_never_returns_ends_its_episode_not_the_rollout(model, tokenizer):
    """The episode stops waiting once its tool time (and as much again as grace, at most 10 s)
    is spent: it ends as tool_time; the other episodes of the rollout run to their end."""
    engine = Engine(model, EngineConfig(slots=4, chunk=4), max_len=256)
    record = {"prompt": "What is 12 * 34?"}
    budget = Budget(max_turns=3, max_tokens=200, turn_tokens=8, max_tool_s=0.5)
    keys = jax.random.split(jax.random.key(0), 1)
    result = []
    rollout = threading.Thread(target=lambda: result.append(run_episodes(
        engine, tokenizer, [[Stuck(record), Chatty(record)]], keys=keys, budget=budget,
        pool=ElasticPool(0, 2),
    )))  # fmt: skip
    rollout.start()
    rollout.join(timeout=120)  # (a hang fails here instead of holding the suite)
    Stuck.release.set()
    assert result, "the rollout waited on a tool that never returns"
    [[stuck, chatty]] = result[0]
    assert (stuck.finish_reason, stuck.tool_s, stuck.turns) == ("tool_time", 0.5, 1)
    assert (chatty.finish_reason, chatty.turns) == ("turns", 3)
    assert engine.idle and engine.blocks_in_use == 0


def test_episode_tokens_equal_the_rendered_conversation(tokenizer):
    """When the model's turns are what the template renders, the token-in/token-out sequence
    is the template's rendering of the whole conversation (the rendered difference is right)."""
    record = {"prompt": "What is 347 * 589?", "answer": "204383"}
    messages = solved_episode(record)["messages"]
    env = make_env("calculator", record)
    turns = Turns(tokenizer, env.schemas)
    history = env.reset()
    assert history == messages[:2]
    ids = turns.prompt(history)
    end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    for model_turn, answer in ((messages[2], messages[3:4]), (messages[4], None)):
        rendered = turns.render([*history, model_turn], generation_prompt=False)
        before = turns.render(history, generation_prompt=True)
        sampled = turns.encode(rendered[len(before) :].removesuffix("<|im_end|>\n")) + end
        ids += sampled
        history = [*history, model_turn]
        if answer is not None:
            ids += turns.observation(history, answer)
            history += answer
    full = tokenizer.apply_chat_template(messages, tools=env.schemas)
    assert ids + turns.encode("\n") == full


def test_tool_errors_are_observations(tokenizer):
    env = make_env("calculator", {"prompt": "What is 2 * 3?"})
    env.reset()
    call = lambda name, **args: {
        "id": "c1",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }  # noqa: E731
    step = env.step(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                call("calculate", expression="2 * 3"),
                call("calculate", expression="import os"),
                call("calculate", expr="1"),
                call("search", query="x"),
            ],
            "tool_call_errors": ["tool call 5 is not valid JSON: Expecting value"],
        }
    )
    assert not step.done and step.info["tool_calls"] == 5 and step.info["tool_errors"] == 4
    contents = [m["content"] for m in step.observations]
    assert contents[0].startswith("Error: tool call 5 is not valid JSON")
    assert contents[1] == "6"
    assert "unsupported" in contents[2] or "not an arithmetic" in contents[2]
    assert "bad arguments for calculate" in contents[3]
    assert "no tool named 'search'" in contents[4]
    assert all(m["role"] == "tool" for m in step.observations)
    final = env.step({"role": "assistant", "content": "6", "tool_call_errors": []})
    assert final.done and final.reward is None  # the record's domain scores "6"


def test_calculate_is_exact_and_refuses_code():
    assert calculate("347 * 589") == "204383"
    assert calculate("(2 + 3) ** 2 - 7 // 2") == "22"
    assert calculate("1 / 4") == "0.25"
    for bad in ("__import__('os')", "2 ** 10 ** 10", "x + 1", "[1] * 3"):
        with pytest.raises(ValueError):
            calculate(bad)


def test_fault_injection_fails_calls_at_its_rate():
    """30% of calls fail (timeouts, errors, empty results), as observations, reproducibly."""
    records = [{"prompt": f"What is {i} * 7?", "answer": str(7 * i)} for i in range(40)]
    outcomes = []
    for r in records:
        env = make_env("fault_injection", r, inner="calculator", rate=0.3, seed=1)
        env.reset()
        for _ in range(5):
            expression = r["prompt"].removeprefix("What is ").removesuffix("?")
            function = {"name": "calculate", "arguments": {"expression": expression}}
            call = {"id": "c", "type": "function", "function": function}
            message = {"role": "assistant", "content": "", "tool_calls": [call]}
            step = env.step(message)
            outcomes.append(step.info["tool_errors"])
    rate = np.mean(outcomes)
    assert 0.2 < rate < 0.4, rate
    # Same seed, same record: the same calls fail.
    again = make_env("fault_injection", records[0], inner="calculator", rate=0.3, seed=1)
    again.reset()
    first = [again.step(message).info["tool_errors"] for _ in range(5)]
    assert first == outcomes[:5]


def test_pool_grows_with_the_queue_and_shrinks_when_idle():
    import threading
    import time

    release = threading.Event()
    pool = ElasticPool(min_workers=1, max_workers=3, idle_s=0.2)
    assert pool.size == 1
    futures = [pool.submit(release.wait) for _ in range(5)]  # more waiting calls than threads
    time.sleep(0.2)
    assert pool.size == 3 and pool.peak == 3  # grew to its bound, not beyond
    release.set()
    assert all(f.result(timeout=5) for f in futures)
    deadline = time.monotonic() + 5
    while pool.size > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.size == 1  # idle threads left, down to min_workers
    assert pool.submit(lambda: 7).result(timeout=5) == 7
    pool.close()


_USER_ENV_CONFIG = """
from posttrain.config import load_config_file
from posttrain.envs import Environment, Step, prompt_messages, register_env


class Chatty(Environment):
    '''Scores its own episodes (rewards=True) but never ends one: every episode is cut by a
    budget, before the environment gives a reward.'''

    def reset(self):
        return prompt_messages(self.record)

    def step(self, message):
        return Step([{{"role": "user", "content": "go on"}}])


register_env("chatty", Chatty, rewards=True)


def get_config(_):
    c = load_config_file({grpo!r})
    c.model.checkpoint = ""  # a random start: the episodes are cut whatever it samples
    c.data.sources = [{{"path": {data!r}, "weight": 1.0, "domain": "chatty", "format": "auto"}}]
    c.eval_data = []
    c.data.batch_size = 4  # x 2 samples: a row per fake device
    c.rollout.num_generations = 2
    c.env.name = "chatty"
    c.env.max_turns = 2
    c.train.steps = 2
    c.train.progress = False
    c.checkpoint.async_save = False
    return c
"""


def test_a_self_rewarding_environments_cut_episodes_train_from_the_cli(tmp_path):
    """An environment registered with rewards=True, whose records name a domain nobody
    registered (as configs/agent.py's terminal presets do), and every episode cut by a budget:
    GRPO from the CLI with the default env.truncated_reward gives them 0, never the reward pool
    (which would stop the run: unknown reward domain 'chatty')."""
    import json

    from posttrain import cli

    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"say {w}"}) + "\n" for w in ("hi", "yo", "ok", "no"))
    )
    config = tmp_path / "user_env.py"
    grpo = os.path.join(REPO, "configs", "grpo.py") + ":tiny"
    config.write_text(_USER_ENV_CONFIG.format(grpo=grpo, data=str(data)))
    workdir = tmp_path / "run"
    assert cli.main(["train", f"--config={config}:x", f"--workdir={workdir}"]) == 0
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("split") == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["episode/truncated"] == 1.0 and r["reward"] == 0.0 for r in train), train
