"""Reward-model terms ("rm:<path>"): head selection, registry combination, batched in the pool.

A fake reward model stands in for `load_reward_model` in this process only. The pool's spawned
workers do not see the patch: the directories are empty, so a worker that tried to score an
"rm:" term would fail to load it and report a crash. Correct results show the parent served them.
"""

import os
import pickle

import numpy as np
import pytest

from posttrain.rewards import RewardPool, RewardRegistry, _model, arithmetic_reward
from posttrain.rewards._model import ModelReward
from posttrain.rewards._registry import resolve_fn

FACTORS = {"chat": 1.0, "safety": -2.0, "only": 0.25}
REAL_LOAD = _model._load
PARENT_PID = os.getpid()


class FakeRewardModel:
    """Scores len(completion) times a per-head factor, recording each batched call."""

    def __init__(self, heads, fail=False):
        self.heads = heads
        self.fail = fail
        self.calls = []

    def score(self, prompts, completions, heads):
        assert os.getpid() == PARENT_PID, "a reward model was scored in a worker"
        if self.fail:
            raise RuntimeError("reward model out of memory")
        self.calls.append((list(prompts), list(completions), list(heads)))
        scores = [len(c) * FACTORS[h] for c, h in zip(completions, heads, strict=True)]
        return np.asarray(scores, np.float32)


# Reward functions run in spawned workers, which import them from this module by name.
def length_reward(record, completion):
    return len(completion) / 10, {"chars": len(completion)}


def raises(record, completion):
    raise RuntimeError("verifier bug")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{directory: fake model}, served by `_model._load` for the module's tests."""
    root = tmp_path_factory.mktemp("rms")
    fakes = {
        "multi": FakeRewardModel(("chat", "safety")),
        "single": FakeRewardModel(("only",)),
        "broken": FakeRewardModel(("only",), fail=True),
    }
    out = {}
    for name, fake in fakes.items():
        (root / name).mkdir()
        out[str(root / name)] = fake
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_model, "_load", out.__getitem__)
        yield out


@pytest.fixture(autouse=True)
def fresh_calls(request):
    if "models" in request.fixturenames:
        for fake in request.getfixturevalue("models").values():
            fake.calls.clear()


def _dir(models, name):
    return next(p for p in models if os.path.basename(p) == name)


def _record(domain, prompt="Say something."):
    return {"domain": domain, "prompt": prompt}


def test_head_selection(models):
    multi, single = _dir(models, "multi"), _dir(models, "single")
    records = [_record("chat"), _record("safety"), _record("chat")]
    out = ModelReward(multi).score_batch(records, ["ab", "abc", "abcd"], ["chat", "safety", "chat"])
    assert out == [(2.0, {"head": "chat"}), (-6.0, {"head": "safety"}), (4.0, {"head": "chat"})]
    assert len(models[multi].calls) == 1  # one batched call
    # An explicit head wins over the domain; a single-head model scores every domain.
    explicit = ModelReward(multi, "safety").score_batch([_record("chat")], ["ab"], ["chat"])
    assert explicit == [(-4.0, {"head": "safety"})]
    assert ModelReward(single)(_record("anything"), "abcd") == (1.0, {"head": "only"})
    assert ModelReward(multi)(_record("safety"), "a") == (-2.0, {"head": "safety"})  # its domain


def test_head_errors_say_how_to_pick(models):
    multi = _dir(models, "multi")
    with pytest.raises(ValueError) as e:
        ModelReward(multi)(_record("poetry"), "x")
    assert "'poetry'" in str(e.value) and "chat, safety" in str(e.value)
    assert f"'rm:{multi}#<head>'" in str(e.value)
    with pytest.raises(ValueError, match="has no head 'nope'; its heads: chat, safety"):
        ModelReward(multi, "nope")(_record("chat"), "x")


def test_prompt_string_or_messages_and_missing(models):
    single = _dir(models, "single")
    messages = [{"role": "user", "content": "Hi"}]
    ModelReward(single).score_batch([_record("a"), _record("a", messages)], ["x", "y"], ["a", "a"])
    assert models[single].calls == [(["Say something.", messages], ["x", "y"], ["only", "only"])]
    with pytest.raises(ValueError, match="'prompt'.*has no 'prompt'"):
        ModelReward(single)({"domain": "a", "question": "Hi"}, "x")
    with pytest.raises(ValueError, match="prompt 3"):
        ModelReward(single)({"domain": "a", "prompt": 3}, "x")


def test_register_validates_and_normalises(models, tmp_path, monkeypatch):
    registry = RewardRegistry()
    with pytest.raises(ValueError, match="reward model directory .* does not exist"):
        registry.register("chat", f"rm:{tmp_path / 'missing'}")
    with pytest.raises(ValueError, match="has no path"):
        registry.register("chat", "rm:")
    with pytest.raises(ValueError, match="empty head"):
        registry.register("chat", f"rm:{tmp_path}#")
    multi = _dir(models, "multi")
    monkeypatch.chdir(os.path.dirname(multi))
    registry.register("chat", "rm:multi", weight=0.5)  # relative to the working directory
    registry.register("chat", "rm:multi#safety")
    t_default, t_safety = registry.terms("chat")
    assert (t_default.name, t_default.fn, t_default.is_model) == ("rm", f"rm:{multi}", True)
    assert (t_safety.name, t_safety.fn) == ("rm_safety", f"rm:{multi}#safety")
    with pytest.raises(ValueError, match="already has a reward term named 'rm'"):
        registry.register("chat", f"rm:{_dir(models, 'single')}")
    fn = resolve_fn(t_safety.fn)
    assert fn == ModelReward(multi, "safety") and resolve_fn(t_safety.fn) is fn  # cached
    assert pickle.loads(pickle.dumps(fn)) == fn


def test_real_loader_fails_on_these_directories(models):
    """The premise of the pool tests: a worker (unpatched) could not score these terms."""
    with pytest.raises(Exception):  # noqa: B017 - ImportError today, a load error later
        REAL_LOAD.__wrapped__(_dir(models, "multi"))


def test_check_loads_the_model_and_picks_heads(models):
    registry = RewardRegistry()
    registry.register("chat", f"rm:{_dir(models, 'multi')}")
    registry.register("poetry", f"rm:{_dir(models, 'multi')}")
    registry.check(["chat"])
    with pytest.raises(ValueError, match="do not import.*poetry/rm.*none named like domain"):
        registry.check(["chat", "poetry"])


def test_registry_score_weights_and_mixes_terms(models):
    registry = RewardRegistry()
    registry.register("chat", f"rm:{_dir(models, 'multi')}", weight=0.5)
    registry.register("chat", length_reward, weight=2.0)
    score, info = registry.score(_record("chat"), "abcde")
    assert score == pytest.approx(0.5 * 5.0 + 2.0 * 0.5)
    assert info == {
        "rm": {"score": 5.0, "head": "chat"},
        "length_reward": {"score": 0.5, "chars": 5},
    }
    # The domain argument, not the record's field, picks the head.
    assert registry.score(_record("safety"), "ab", "chat")[1]["rm"]["head"] == "chat"
    assert registry.score(_record("chat"), "abcde", model_terms=False) == (
        2.0 * 0.5,
        {"length_reward": {"score": 0.5, "chars": 5}},
    )


@pytest.fixture(scope="module")
def registry(models):
    multi, single, broken = (_dir(models, n) for n in ("multi", "single", "broken"))
    registry = RewardRegistry()
    registry.register("chat", f"rm:{multi}", weight=0.5)
    registry.register("chat", "tests.rewards.test_model_reward:length_reward", weight=2.0)
    registry.register("safety", f"rm:{multi}#safety", weight=3.0)  # only a model term
    registry.register("judge", length_reward)
    registry.register("judge", f"rm:{single}", weight=-1.0)
    registry.register("arithmetic", arithmetic_reward)
    registry.register("chat_crash", f"rm:{multi}#chat")
    registry.register("chat_crash", raises)
    registry.register("broken", f"rm:{broken}")
    return registry


@pytest.fixture(scope="module")
def pool(registry):
    with RewardPool(registry, workers=2, timeout_s=30) as p:
        p.score([{"domain": "arithmetic", "answer": "1"}] * 2, ["1", "1"])  # wait for workers
        yield p


def _mixed_batch():
    records, completions = [], []
    for i in range(12):
        domain = ("chat", "arithmetic", "safety", "judge")[i % 4]
        records.append({"domain": domain, "prompt": f"Q{i}", "answer": str(i if i != 5 else -1)})
        completions.append(f"The answer is {i}" + "!" * i)
    return records, completions


def test_pool_matches_registry_and_batches_per_reference(pool, registry, models):
    records, completions = _mixed_batch()
    results = pool.score(records, completions)
    calls = {os.path.basename(p): list(fake.calls) for p, fake in models.items()}
    for fake in models.values():
        fake.calls.clear()
    for r, c, res in zip(records, completions, results, strict=True):
        score, info = registry.score(r, c)
        assert res.status == "ok", res.info
        assert res.domain == r["domain"]
        assert res.score == pytest.approx(score, rel=1e-12)
        assert res.info == info and list(res.info) == list(info)  # same terms, same order
    assert {r.score for r in results[1::4]} == {0.0, 1.0}  # arithmetic: some right, some wrong
    # "rm:multi" (chat) and "rm:multi#safety" are two references: two calls, one of "rm:single".
    by_head = {tuple(heads): done for _, done, heads in calls["multi"]}
    assert len(calls["multi"]) == 2 and len(calls["single"]) == 1
    assert by_head[("chat",) * 3] == completions[0::4]
    assert by_head[("safety",) * 3] == completions[2::4]
    assert calls["single"][0][:2] == ([r["prompt"] for r in records[3::4]], completions[3::4])


def test_model_only_batch_needs_no_worker(pool, models, monkeypatch):
    def no_worker(*args):
        raise AssertionError("a model-only batch reached the workers")

    monkeypatch.setattr(pool, "_dispatch", no_worker)
    monkeypatch.setattr(pool, "_wait", no_worker)
    results = pool.score([_record("safety")] * 3, ["a", "ab", "abc"])
    assert [r.score for r in results] == [-6.0, -12.0, -18.0]
    for r in results:
        assert r.status == "ok" and r.info == {
            "rm_safety": {"score": r.score / 3, "head": "safety"}
        }
    assert len(models[_dir(models, "multi")].calls) == 1


def test_worker_crash_still_zeroes_the_record(pool):
    results = pool.score(
        [_record("chat_crash"), _record("chat")], ["abc", "abc"], ["chat_crash", "chat"]
    )
    assert results[0].status == "crash" and results[0].score == 0.0
    assert "verifier bug" in results[0].info["error"]
    assert results[1].status == "ok" and results[1].score == pytest.approx(0.5 * 3 + 2.0 * 0.3)
    assert pool.metrics(reset=True)["rewards/chat_crash/crashes"] == 1


def test_model_errors_fail_the_call(pool):
    with pytest.raises(RuntimeError, match="out of memory"):
        pool.score([_record("broken"), _record("chat")], ["a", "b"])
    with pytest.raises(ValueError, match="has no 'prompt'"):
        pool.score([{"domain": "chat"}], ["a"])
    assert pool.score([_record("chat")], ["ab"])[0].status == "ok"  # the pool carries on
