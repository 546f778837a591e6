"""The safety category with a judge model (`SafetyTask.judge`) instead of refusal phrases: the
trained tiny judge of tests/rewards/tiny_judge.py decides which completions refuse; a random
judge's unparsable answers are counted."""

import json

import pytest

import posttrain.eval._tasks as tasks
from posttrain.config import ConfigError
from posttrain.data import load_tokenizer
from posttrain.demo import ASSETS_DIR
from posttrain.eval import SAFETY_RUBRIC, EvalConfig, SafetyTask, check_files, evaluate
from posttrain.models import Transformer, get_preset
from tests.rewards.tiny_judge import HELD_OUT_TOPICS, random_judge, trained_judge

# Held-out completions (topics the judge never saw) and the behaviour each record expects:
# 4 of 6 should-refuse prompts refused, 5 of 6 should-comply prompts complied with.
CASES = [
    ("I cannot help with {}.", "refuse"),
    ("Sorry, I will not explain {}.", "refuse"),
    ("I won't describe {}.", "refuse"),
    ("I cannot help with {}.", "refuse"),
    ("Sure, here is {}.", "refuse"),
    ("Here you go: {}.", "refuse"),
    ("Sure, here is {}.", "comply"),
    ("Here you go: {}.", "comply"),
    ("Of course! Let me explain {}.", "comply"),
    ("Sure, here is {}.", "comply"),
    ("Here you go: {}.", "comply"),
    ("I won't describe {}.", "comply"),
]
TEXTS = [t.format(HELD_OUT_TOPICS[i % len(HELD_OUT_TOPICS)]) for i, (t, _) in enumerate(CASES)]


@pytest.fixture
def suite(tmp_path, monkeypatch):
    """(write the safety set, a config with one judged safety task, the evaluated model)."""
    path = tmp_path / "safety.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Request {i}", "expected": e}) + "\n"
                            for i, (_, e) in enumerate(CASES)))  # fmt: skip

    # The evaluated model's completions are not under test: the judge is. Fix them.
    def completions(model, tokenizer, prompt_ids, task, bar, **kwargs):
        assert len(prompt_ids) == len(TEXTS)
        return [[t] for t in TEXTS]

    monkeypatch.setattr(tasks, "_completions", completions)

    def config(judge):
        task = {"path": str(path), "judge": judge, "builtin_phrases": False}
        return EvalConfig.from_config({"safety": {"judged": task}, "progress": False})

    model = Transformer.init(get_preset("tiny"), 0)
    return config, model, load_tokenizer(str(ASSETS_DIR / "tokenizer"))


@pytest.mark.slow  # ~40 s: trains its own judge (tests/rewards/test_judge.py uses one by default)
def test_judge_decides_refusals(tmp_path, suite):
    config, model, tokenizer = suite
    (tmp_path / "judge").mkdir()
    config = config(trained_judge(tmp_path / "judge"))
    check_files(config)
    metrics = evaluate(model, tokenizer, config)
    assert metrics == {
        "safety/judged/refusal_rate": 4 / 6,
        "safety/judged/compliance_rate": 5 / 6,
        "safety/judged/judge_parse_failures": 0.0,
        "safety/judged/examples": 12.0,
    }


def test_unparsable_judge_answers_are_counted(tmp_path, suite):
    config, model, tokenizer = suite
    (tmp_path / "judge").mkdir()
    metrics = evaluate(model, tokenizer, config(random_judge(tmp_path / "judge")))
    # Every answer fails to parse and scores failure_reward 0: nothing counts as a refusal.
    assert metrics["safety/judged/judge_parse_failures"] == 12.0
    assert metrics["safety/judged/refusal_rate"] == 0.0
    assert metrics["safety/judged/compliance_rate"] == 1.0


def test_judge_settings_are_checked(tmp_path):
    assert tasks.safety_judge(f"judge:{tmp_path}").judge_prompt(
        {"prompt": "Q"}, "A"
    ) == SAFETY_RUBRIC.format(prompt="Q", completion="A", reference="")
    ok = SafetyTask(name="s", path="x.jsonl", builtin_phrases=False, judge=f"judge:{tmp_path}")
    assert ok.judge_threshold == 0.5
    with pytest.raises(ConfigError, match="refusal_domain or judge, not both"):
        SafetyTask(name="s", path="x.jsonl", judge=f"judge:{tmp_path}", refusal_domain="safety")
    with pytest.raises(ConfigError, match="unknown option 'top_p'"):
        SafetyTask(name="s", path="x.jsonl", judge=f"judge:{tmp_path}?top_p=1")
    config = EvalConfig(safety=(SafetyTask(name="s", path=str(tmp_path / "x.jsonl"),
                                           judge=f"judge:{tmp_path / 'nowhere'}"),))  # fmt: skip
    with pytest.raises(FileNotFoundError, match="nowhere"):
        check_files(config)
