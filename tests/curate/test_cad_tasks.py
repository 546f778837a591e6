"""The CAD task files: reproducible from their arguments, held-out tasks kept out, SFT
trajectories that say what the `cad` environment says."""

import json
import shutil

import pytest

from posttrain.curate import build_cad_assets
from posttrain.data import load_tokenizer
from posttrain.envs import make_env

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")


def _rows(path):
    return [json.loads(line) for line in open(path)]


def test_assets_are_reproducible_and_keep_held_out_tasks_apart(tmp_path):
    sizes = {"n_sft": 24, "n_train": 12, "n_eval": 6, "levels": (1, 2, 3)}
    a = build_cad_assets(tmp_path / "a", **sizes)
    b = build_cad_assets(tmp_path / "b", **sizes)
    for name in ("sft", "trajectories", "train", "eval"):
        assert open(a[name], "rb").read() == open(b[name], "rb").read(), name
    assert (
        open(f"{a['tokenizer']}/tokenizer.json").read()
        == open(f"{b['tokenizer']}/tokenizer.json").read()
    )
    held_out = {r["prompt"][0]["content"] for r in _rows(a["eval"])}
    assert len(held_out) == 6
    sft = {r["messages"][0]["content"] for r in _rows(a["sft"])}
    train = {r["prompt"][0]["content"] for r in _rows(a["train"])}
    assert len(sft) == 24 and len(train) == 12 and not held_out & (sft | train)
    families = {r["family"] for r in _rows(a["train"])}
    assert families & {"plate"} and families & {"bracket", "flange"}
    assert families & {"gear", "enclosure"}
    # RL prompt records hold no reference script (only what the reward reads: the required
    # features and the gated total by default).
    rl = _rows(a["train"]) + _rows(a["eval"])
    assert all("reference" not in r and r["features"] and r["aggregate"] == "gated" for r in rl)
    # Held-out tasks do not depend on the other sizes.
    c = build_cad_assets(tmp_path / "c", n_sft=3, n_train=2, n_eval=6, levels=(1, 2, 3))
    assert open(c["eval"], "rb").read() == open(a["eval"], "rb").read()
    # The tokenizer spells scripts and chats losslessly.
    tokenizer = load_tokenizer(a["tokenizer"])
    chat = _rows(a["sft"])[0]["messages"]
    script = chat[1]["content"]
    assert tokenizer.decode(tokenizer.encode(script)) == script


@needs_bwrap
def test_trajectories_show_what_the_environment_answers(tmp_path):
    paths = build_cad_assets(tmp_path, n_sft=3, n_train=1, n_eval=1, levels=(1, 2, 3))
    tokenizer = load_tokenizer(paths["tokenizer"])
    for record in _rows(paths["trajectories"]):
        system, user, call, tool, answer = record["messages"]
        env = make_env("cad", {"prompt": user["content"], "domain": "cad"})
        opening = env.reset()
        assert [m["content"] for m in opening] == [system["content"], user["content"]]
        assert env.schemas == record["tools"]  # the tool as the environment describes it
        # The environment's answer to the trajectory's call is the trajectory's tool turn.
        step = env.step({**call, "tool_calls": [{"id": "c1", **call["tool_calls"][0]}]})
        assert step.observations[0]["content"] == tool["content"]
        assert "1 separate body" in tool["content"]
        text = tokenizer.decode(
            tokenizer.apply_chat_template(record["messages"], tools=record["tools"])
        )
        assert "<tool_call>" in text and "Tool: build_part" in text


def test_unshown_leaves_cad_show_out_of_that_share_of_sft_scripts_only(tmp_path):
    sizes = {"n_sft": 40, "n_train": 2, "n_eval": 2, "levels": (1, 2, 3)}
    clean = _rows(build_cad_assets(tmp_path / "clean", **sizes)["sft"])
    paths = build_cad_assets(tmp_path / "flawed", unshown=0.5, **sizes)
    flawed = _rows(paths["sft"])
    shown = ["cad.show(part)" in r["messages"][1]["content"] for r in flawed]
    assert 10 <= shown.count(False) <= 30 and all(
        "cad.show(part)" in r["messages"][1]["content"] for r in clean
    )
    for c, f, s in zip(clean, flawed, shown, strict=True):  # the same tasks, one line less
        answer = c["messages"][1]["content"]
        assert f["messages"][1]["content"] == (
            answer if s else answer.replace("cad.show(part)\n", "")
        )
    assert all(
        "cad.show(part)" in r["messages"][-1]["content"] for r in _rows(paths["trajectories"])
    )
