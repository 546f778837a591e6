"""Reward registry: registration, weighted combination, startup checks, default domains."""

import functools
import math

import pytest

from posttrain.demo import make_problem
from posttrain.rewards import RewardRegistry, default_registry


def always(record, completion, value=1.0):
    return value, {"seen": completion}


def length_reward(record, completion):
    return len(completion) / 10, {}


def returns_nan(record, completion):
    return math.nan, {}


def returns_bare_float(record, completion):
    return 1.0


def test_weighted_sum_and_info_by_term():
    registry = RewardRegistry()
    registry.register("mix", always, weight=0.7)
    registry.register("mix", length_reward, weight=0.3)
    registry.register("mix", functools.partial(always, value=-1.0), weight=2.0, name="penalty")
    score, info = registry.score({"domain": "mix"}, "abcde")
    assert score == pytest.approx(0.7 * 1.0 + 0.3 * 0.5 + 2.0 * -1.0)
    assert info == {
        "always": {"score": 1.0, "seen": "abcde"},
        "length_reward": {"score": 0.5},
        "penalty": {"score": -1.0, "seen": "abcde"},
    }
    assert [t.name for t in registry.terms("mix")] == ["always", "length_reward", "penalty"]


def test_register_by_reference_string():
    registry = RewardRegistry()
    registry.register("ref", "tests.rewards.test_registry:length_reward", weight=2.0)
    assert registry.score({}, "abcde", domain="ref") == (1.0, {"length_reward": {"score": 0.5}})


def test_check_names_all_unknown_domains_with_close_matches():
    registry = default_registry()
    registry.check(["math", "format", "math"])
    with pytest.raises(ValueError) as e:
        registry.check(["math", "mathh", "tool-call", "astronomy"])
    message = str(e.value)
    assert "'mathh' (did you mean 'math'?)" in message
    assert "'tool-call' (did you mean 'tool_call'?)" in message
    assert "'astronomy'" in message
    assert (
        "Registered: arithmetic, cad, code, code_quality, extraction, format, grounded_qa, math, "
        "tool_call" in message
    )


def test_check_resolves_references():
    registry = RewardRegistry()
    registry.register("ok", "tests.rewards.test_registry:always")
    registry.register("typo", "tests.rewards.test_registry:alwayz")
    registry.register("gone", "posttrain.no_such_module:fn")
    registry.check(["ok"])
    registry.check(["typo", "gone"], resolve=False)
    with pytest.raises(ValueError, match="do not import") as e:
        registry.check(["ok", "typo", "gone"])
    assert "typo/alwayz" in str(e.value) and "gone/fn" in str(e.value)


def test_register_rejects_what_cannot_reach_a_worker():
    registry = RewardRegistry()
    with pytest.raises(ValueError, match="cannot be pickled"):
        registry.register("lambda", lambda r, c: (1.0, {}))

    def nested(record, completion):
        return 1.0, {}

    with pytest.raises(ValueError, match="cannot be pickled"):
        registry.register("nested", nested)
    with pytest.raises(ValueError, match="package.module:function"):
        registry.register("bad_ref", "no_colon_here")
    with pytest.raises(ValueError, match="finite"):
        registry.register("w", always, weight=math.inf)
    registry.register("dup", always)
    with pytest.raises(ValueError, match="already has a reward term named 'always'"):
        registry.register("dup", always)


def test_bad_return_values_raise():
    registry = RewardRegistry()
    registry.register("nan", returns_nan)
    registry.register("bare", returns_bare_float)
    with pytest.raises(ValueError, match="non-finite"):
        registry.score({"domain": "nan"}, "x")
    with pytest.raises(ValueError, match=r"must return \(score, info dict\)"):
        registry.score({"domain": "bare"}, "x")


def test_record_without_domain():
    with pytest.raises(ValueError, match="no 'domain' field"):
        default_registry().score({"answer": "2"}, "2")


def test_default_domains_score_in_process():
    registry = default_registry()
    assert registry.domains() == [
        "arithmetic", "cad", "code", "code_quality", "extraction", "format", "grounded_qa", "math",
        "tool_call",
    ]  # fmt: skip
    assert registry.score({"domain": "math", "answer": r"\frac{1}{2}"}, r"\boxed{0.5}")[0] == 1.0
    layout = "<think>hmm</think>\n<answer>4</answer>"
    assert registry.score({"domain": "format"}, layout)[0] == 1.0
    tools = [{"name": "now", "parameters": {"type": "object", "properties": {}}}]
    call = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    assert registry.score({"domain": "tool_call", "tools": tools}, call)[0] == 1.0


def test_arithmetic_domain_uses_the_demo_verifier():
    import random

    record = make_problem(random.Random(0))
    registry = default_registry()
    score, info = registry.score(record, f"The result is {record['answer']}.")
    assert score == 1.0 and info["arithmetic_reward"]["extracted"] == record["answer"]
    score, info = registry.score(record, "no idea")
    assert score == 0.0 and info["arithmetic_reward"]["reason"] == "no integer answer"
