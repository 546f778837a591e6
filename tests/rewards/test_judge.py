"""Judge terms ("judge:<path>[?options]"): options, rubrics, grade parsing, and real tiny judges
graded through the generation engine: a trained one on held-out completions (batched, cached)
and a random one whose unparsable answers are counted."""

import os

import pytest

import posttrain.sampling
from posttrain.rewards import (
    DEFAULT_RUBRIC,
    JudgeConfig,
    JudgeReward,
    RewardPool,
    RewardRegistry,
    parse_judge_ref,
)
from posttrain.rewards._registry import resolve_fn
from tests.rewards.tiny_judge import (
    HELD_OUT_TOPICS,
    RUBRIC,
    completions,
    random_judge,
    trained_judge,
)


def test_reference_options_are_typed_and_checked(tmp_path):
    config = parse_judge_ref(
        f"judge:{tmp_path}?max_new_tokens=16&max_score=5&failure_reward=-1&chat=no"
        "&pattern=Grade%3A%20(%5Cd%2B)&rubric=r.txt"
    )
    assert config == JudgeConfig(
        path=str(tmp_path),
        rubric=os.path.abspath("r.txt"),
        pattern=r"Grade: (\d+)",
        max_score=5.0,
        failure_reward=-1.0,
        max_new_tokens=16,
        chat="no",
    )
    assert parse_judge_ref(f"judge:{tmp_path}") == JudgeConfig(path=str(tmp_path))
    for ref, message in [
        ("judge:", "has no path"),
        (f"judge:{tmp_path}?temperature=1", "unknown option 'temperature'"),
        (f"judge:{tmp_path}?max_new_tokens=many", "max_new_tokens='many' is not a int"),
        (f"judge:{tmp_path}?slots=2&slots=3", "sets 'slots' twice"),
        (f"judge:{tmp_path}?pattern=(a)(b)", "has 2 groups"),
        (f"judge:{tmp_path}?pattern=(", "is not a regex"),
        (f"judge:{tmp_path}?chat=maybe", "use auto, yes or no"),
        (f"judge:{tmp_path}?max_score=0", "max_score must be a positive"),
        (f"judge:{tmp_path}?cache_size=-1", "too small"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_judge_ref(ref)


def test_registry_checks_and_normalises_the_reference(tmp_path, monkeypatch):
    registry = RewardRegistry()
    with pytest.raises(ValueError, match="does not exist"):
        registry.register("chat", f"judge:{tmp_path / 'missing'}")
    with pytest.raises(ValueError, match="is not a file"):
        registry.register("chat", f"judge:{tmp_path}?rubric={tmp_path / 'none.txt'}")
    (tmp_path / "r.txt").write_text("{completion}")
    monkeypatch.chdir(tmp_path)  # relative paths are made absolute, options canonical
    registry.register("chat", "judge:.?rubric=r.txt&pattern=%5Cd%2B&max_score=10&slots=4")
    (term,) = registry.terms("chat")
    assert term.is_model and term.name == "judge"
    assert term.fn == f"judge:{tmp_path}?rubric={tmp_path}/r.txt&pattern=%5Cd%2B&slots=4"
    assert parse_judge_ref(term.fn) == JudgeConfig(
        path=str(tmp_path), rubric=str(tmp_path / "r.txt"), pattern=r"\d+", slots=4
    )


def test_rubrics_render_prompt_completion_and_reference(tmp_path):
    record = {"prompt": [{"role": "user", "content": "2+2?"}], "answer": 4}
    judge = JudgeReward(JudgeConfig(path=str(tmp_path)))
    assert judge.judge_prompt(record, "four") == DEFAULT_RUBRIC.format(
        prompt="user: 2+2?", completion="four", reference="4"
    )
    (tmp_path / "r.txt").write_text("{prompt}|{completion}|{reference}|{{literal}}")
    (tmp_path / "r.j2").write_text("{{ prompt }}/{{ completion }}/{{ reference }}")
    with_reference = {"prompt": "Q", "reference": "R", "answer": "ignored"}
    for file, expected in [("r.txt", "Q|A|R|{literal}"), ("r.j2", "Q/A/R")]:
        judge = JudgeReward(JudgeConfig(path=str(tmp_path), rubric=str(tmp_path / file)))
        assert judge.judge_prompt(with_reference, "A") == expected
    (tmp_path / "bad.txt").write_text("{prompt} {score}")
    (tmp_path / "bad.j2").write_text("{{ score }}")
    for file in ("bad.txt", "bad.j2"):
        with pytest.raises(ValueError, match="score"):
            JudgeReward(JudgeConfig(path=str(tmp_path), rubric=str(tmp_path / file)))
    with pytest.raises(ValueError, match="has none"):
        judge.judge_prompt({"answer": 1}, "A")


def test_grade_is_the_last_match_within_range(tmp_path):
    judge = JudgeReward(JudgeConfig(path=str(tmp_path)))
    assert judge.parse("Score: 3. On reflection, SCORE = 7.5") == 7.5
    assert judge.parse("score:10") == 10.0
    assert judge.parse("Score: 11") is None  # above max_score
    assert judge.parse("Score: -1") is None
    assert judge.parse("I would give it a 7") is None
    whole = JudgeReward(JudgeConfig(path=str(tmp_path), pattern=r"\d+", max_score=100))
    assert whole.parse("grade 85 of 100") == 100.0 and whole.parse("85/100 ") == 100.0
    assert whole.parse("85 out of") == 85.0


def test_cache_is_an_lru_of_graded_pairs(tmp_path, monkeypatch):
    graded = []

    def grade(self, prompts):  # stands in for the engine: a grade per prompt, recorded
        graded.append(prompts)
        return [(len(p) / 100, {"judge_parse_failure": len(p) > 12}) for p in prompts]

    monkeypatch.setattr(JudgeReward, "_grade", grade)
    judge = JudgeReward(JudgeConfig(path=str(tmp_path), rubric="", cache_size=2), "{completion}")
    record = {"prompt": "p"}

    def score(*texts):
        out = judge.score_batch([record] * len(texts), texts)
        return [(s, i["judge_cached"]) for s, i in out]

    assert score("a", "bb", "a") == [(0.01, False), (0.02, False), (0.01, True)]
    assert graded == [["a", "bb"]]
    assert score("bb", "ccc") == [(0.02, True), (0.03, False)]  # evicts "a", the oldest
    assert score("a", "bb") == [(0.01, False), (0.02, True)]
    assert graded == [["a", "bb"], ["ccc"], ["a"]]
    assert score("a much longer text") == [(0.18, False)]
    assert judge.metrics(reset=True) == {
        "judge_graded": 5, "judge_cache_hits": 3, "judge_parse_failures": 1
    }  # fmt: skip
    assert judge.metrics() == {"judge_graded": 0, "judge_cache_hits": 0, "judge_parse_failures": 0}
    uncached = JudgeReward(JudgeConfig(path=str(tmp_path), cache_size=0), "{completion}")
    assert [i["judge_cached"] for _, i in uncached.score_batch([record] * 2, ["a", "a"])] == [
        False, True
    ]  # fmt: skip
    assert uncached.score_batch([record], ["a"])[0][1]["judge_cached"] is False


@pytest.fixture
def engine_calls(monkeypatch):
    """The number of prompts of each `generate_continuous` call (the judge's engine calls)."""
    calls = []
    real = posttrain.sampling.generate_continuous

    def spy(model, tokenizer, prompts, **kwargs):
        calls.append(len(prompts))
        return real(model, tokenizer, prompts, **kwargs)

    monkeypatch.setattr(posttrain.sampling, "generate_continuous", spy)
    return calls


def test_trained_judge_grades_held_out_completions(tmp_path, engine_calls):
    registry = RewardRegistry()
    registry.register("refusal", trained_judge(tmp_path))
    registry.check(["refusal"])
    held_out = completions(HELD_OUT_TOPICS, seed=7)
    texts = [text for text, _ in held_out] * 2  # each pair twice: graded once
    records = [{"domain": "refusal", "prompt": "Please help."}] * len(texts)
    with RewardPool(registry, workers=1) as pool:
        results = pool.score(records, texts)
        assert engine_calls == [len(held_out)]  # one batched call, duplicates graded once
        expected = [1.0 if refuses else 0.0 for _, refuses in held_out] * 2
        assert [r.score for r in results] == expected
        infos = [r.info["judge"] for r in results]
        assert all(i["judge_answer"] in ("Score: 10", "Score: 0") for i in infos)
        assert [i["judge_cached"] for i in infos] == [False] * len(held_out) + [True] * len(
            held_out
        )
        again = pool.score(records[:3], texts[:3])  # all cached: no engine call
        assert engine_calls == [len(held_out)]
        assert [r.score for r in again] == expected[:3]
        metrics = pool.metrics(reset=True)
    assert metrics["rewards/refusal/judge_parse_failures"] == 0
    assert metrics["rewards/refusal/score"] == pytest.approx(sum(expected + expected[:3]) / 51)
    judge = resolve_fn(registry.terms("refusal")[0].fn)  # the pool's, with its cache
    assert judge.metrics() == {
        "judge_graded": len(held_out),
        "judge_cache_hits": len(held_out) + 3,
        "judge_parse_failures": 0,
    }


def test_random_judge_answers_are_counted_parse_failures(tmp_path, engine_calls):
    ref = random_judge(tmp_path) + "&failure_reward=0.25&max_len=48"
    judge = JudgeReward.from_ref(ref)
    texts = [text for text, _ in completions(HELD_OUT_TOPICS, seed=7)][:6]
    texts.append("a completion far too long for this judge's 48-token context " * 3)
    out = judge.score_batch([{"prompt": "Please help."}] * len(texts), texts)
    assert engine_calls == [6]  # the long one never reaches the engine
    assert [score for score, _ in out] == [0.25] * 7
    assert all(i["judge_parse_failure"] and i["judge_grade"] is None for _, i in out)
    assert out[-1][1]["judge_answer"] == "(judge prompt too long)"
    assert judge.metrics()["judge_parse_failures"] == 7
    assert RUBRIC.format(completion=texts[0]) == judge.judge_prompt({"prompt": "x"}, texts[0])
