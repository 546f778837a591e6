"""The `clarify` environment: a scripted policy that asks for what the request leaves out scores
more than one that never asks or asks everything; the scripted user answers from the full
specification, costs every question and charges more for what the request already said; the
final program runs against the hidden tests in the sandbox."""

import json
import shutil

import numpy as np
import pytest

from posttrain.envs import CLARIFY_SYSTEM, clarify_tasks, make_env, scripted_turns
from posttrain.envs._clarify import FAMILIES, QUESTION_COST, REDUNDANT_COST, UNKNOWN

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
ASSETS = "posttrain/envs/assets/clarify_tasks.jsonl"


def _play(record, turns, **options):
    """(reward, the user's replies, the last step's info) of an episode played by `turns`."""
    env = make_env("clarify", record, **options)
    assert env.reset()[0] == {"role": "system", "content": CLARIFY_SYSTEM}
    replies = []
    for turn in turns:
        step = env.step({"role": "assistant", "content": turn})
        if step.done:
            return step.reward, replies, step.info
        replies.append(step.observations[0]["content"])
    raise AssertionError("the episode did not end at the code")


def test_asking_what_is_missing_scores_more_than_not_asking_or_asking_everything():
    tasks = clarify_tasks(24, seed=1)  # every family 4 times
    assert {t["spec"]["family"] for t in tasks} == {f.name for f in FAMILIES}
    rewards = {"hidden": [], "all": [], "none": []}
    for task in tasks:
        facts = task["spec"]["facts"]
        hidden = sum(not f["shown"] for f in facts)
        shown = len(facts) - hidden
        reward, replies, info = _play(task, scripted_turns(task, "hidden"))
        # Each question got its fact's answer; the code then passes every hidden test.
        assert replies == [f["answer"] for f in facts if not f["shown"]], replies
        assert info["tests_passed"] == 1.0
        assert reward == pytest.approx(1 - QUESTION_COST * hidden)
        rewards["hidden"].append(reward)
        reward, _, info = _play(task, scripted_turns(task, "all"))
        assert info["tests_passed"] == 1.0
        assert reward == pytest.approx(1 - QUESTION_COST * len(facts) - REDUNDANT_COST * shown)
        rewards["all"].append(reward)
        reward, _, info = _play(task, scripted_turns(task, []))  # guesses what was left out
        assert info["tests_passed"] < 1.0, task["spec"]
        rewards["none"].append(reward)
    means = {k: float(np.mean(v)) for k, v in rewards.items()}
    assert means["hidden"] > means["all"] and means["hidden"] > means["none"] + 0.3, means


def test_the_user_answers_from_the_full_specification():
    task = next(t for t in clarify_tasks(12, seed=3) if t["spec"]["family"] == "truncate"
                and [f["shown"] for f in t["spec"]["facts"]] == [False, True])  # fmt: skip
    length, suffix = task["spec"]["facts"]
    code = f"```python\n{task['solution']}```"
    # A question that names no fact: "I don't know", and it still costs.
    reward, replies, _ = _play(task, ["Which language should I use?", code])
    assert replies == [UNKNOWN] and reward == pytest.approx(1 - QUESTION_COST)
    # What the request said already: answered, and charged as redundant.
    reward, replies, _ = _play(task, ["What suffix marks a cut text?", code])
    assert replies == [suffix["answer"]]
    assert reward == pytest.approx(1 - QUESTION_COST - REDUNDANT_COST)
    # One question naming both facts gets both; not redundant (one was hidden).
    reward, replies, _ = _play(task, ["How many characters, and what suffix?", code])
    assert replies == [f"{length['answer']} {suffix['answer']}"]
    assert reward == pytest.approx(1 - QUESTION_COST)
    # The reward never goes below 0.
    reward, _, _ = _play(task, ["What is the suffix?"] * 12 + [code])
    assert reward == 0.0


def test_a_model_user_answers_through_the_judge_path(tmp_path, monkeypatch):
    """user="judge:<path>": each question goes to a generative model (one engine call), its
    greedy answer is the reply, and a question costs what it costs with the scripted user. The
    model is the judge tests' trained one, whose answers are known: "Score: 10" to a refusal,
    "Score: 0" to a reply that complies (its rubric shows it only the question)."""
    import posttrain.sampling
    from tests.rewards.tiny_judge import HELD_OUT_TOPICS, completions, trained_judge

    calls, engine = [], posttrain.sampling.generate_continuous
    monkeypatch.setattr(posttrain.sampling, "generate_continuous",
                        lambda *a, **k: calls.append(len(a[2])) or engine(*a, **k))  # fmt: skip
    task = clarify_tasks(1, seed=0)[0]
    ref = trained_judge(tmp_path)
    code = f"```python\n{task['solution']}```"
    asked = completions(HELD_OUT_TOPICS, seed=7)[:6] + [("What is the maximum?", None)]
    turns = [question for question, _ in asked] + [code]
    reward, replies, _ = _play(task, turns, user=ref)
    assert replies[:6] == ["Score: 10" if refuses else "Score: 0" for _, refuses in asked[:6]]
    assert calls == [1] * 7  # a call per question, the code none
    assert reward == _play(task, turns)[0] < 1.0  # the scripted user's costs
    # Without a rubric of its own, the model reads the request, every fact and the question.
    env = make_env("clarify", task, user=f"judge:{tmp_path}?chat=no")
    prompt = env.user_prompt("What is the maximum?")
    assert task["prompt"] in prompt and prompt.endswith("answer: I don't know.")
    assert all(f["answer"] in prompt for f in task["spec"]["facts"])
    assert "The programmer asks: What is the maximum?" in prompt
    # A question whose prompt does not fit the model's context: "I don't know", still charged.
    reward, replies, _ = _play(task, ["What is the maximum?", code], user=ref + "&max_len=16")
    assert replies == [UNKNOWN] and reward == _play(task, ["What is the maximum?", code])[0]
    assert calls == [1] * 7  # it never reached the engine
    with pytest.raises(ValueError, match="'scripted' or a model through the judge path"):
        make_env("clarify", task, user="gpt-4")


def test_the_final_program_runs_contained_and_bad_records_are_refused(tmp_path):
    task = clarify_tasks(1, seed=0)[0]
    canary = tmp_path / "escaped"
    hostile = f"```python\nopen({str(canary)!r}, 'w').write('x')\nwhile True:\n    pass\n```"
    reward, _, info = _play(task, [hostile])
    assert reward == 0.0 and info["tests_passed"] == 0.0 and not canary.exists()
    with pytest.raises(ValueError, match="a clarify record needs 'spec'"):
        make_env("clarify", {"prompt": "Write a function."})


def test_the_bundled_set_is_the_generators():
    with open(ASSETS) as f:
        bundled = [json.loads(line) for line in f]
    assert bundled == json.loads(json.dumps(clarify_tasks(60, seed=0)))
    assert all(any(not f["shown"] for f in t["spec"]["facts"]) for t in bundled)


@pytest.mark.slow  # ~4 minutes: `posttrain demo --task=clarify`
def test_a_tiny_model_learns_to_ask(tmp_path, devices):
    """configs/agent.py:clarify_sft warm-starts the tiny model on scripted episodes (half ask,
    half guess), then configs/agent.py:clarify's GRPO: on held-out tasks the model asks more
    often and its reward rises (measured 2026-12-06: asked 52% -> 80%, questions per episode
    0.64 -> 0.98, reward 0.70 -> 0.79, tests passed 73% -> 83%; docs/agents.md)."""
    from posttrain.demo import run_clarify_demo

    result = run_clarify_demo(str(tmp_path), sft_overrides={"train.progress": False},
                              rl_overrides={"train.progress": False})  # fmt: skip
    before, after = result["sft"], result["rl"]
    assert 0.2 < before["asked"] < 0.8, before  # the warm start asks some of the time
    assert after["asked"] >= before["asked"] + 0.15, (before, after)
    assert after["reward"] > before["reward"] + 0.03, (before, after)
    assert after["redundant"] <= 0.1, after
