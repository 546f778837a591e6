"""Several domains in one RL run: per-domain metrics, adaptive weights, difficulty filtering."""

import json

import pytest

from posttrain.methods import run_from_config
from posttrain.train import read_metrics

from .toy import TWO_DOMAIN_REWARDS, toy_config, two_domain_prompts


def _config(tmp_path, **overrides):
    source = {"path": two_domain_prompts(tmp_path / "prompts.jsonl"), "weight": 1.0,
              "domain": "digits", "format": "auto"}  # fmt: skip
    return toy_config(data__sources=[source], rewards__domains=TWO_DOMAIN_REWARDS, **overrides)


def test_adaptive_weights_move_to_the_domain_with_signal(tmp_path):
    config = _config(tmp_path, train__steps=12, domains__adaptive=True, domains__smoothing=0.5)
    run_from_config(config, str(tmp_path / "run"))
    rows = read_metrics(str(tmp_path / "run"))
    for key in ("reward/digits", "reward/solved", "pass_rate/digits", "response_length/solved"):
        assert any(key in r for r in rows), key
    assert all(r.get("reward/solved", 1.0) == 1.0 for r in rows)
    first, last = rows[0]["domain_weight/digits"], rows[-1]["domain_weight/digits"]
    # "solved" never has signal: its weight falls toward the floor, "digits" takes the rest.
    assert first < last and last > 0.8, (first, last)
    assert rows[-1]["domain_weight/digits"] + rows[-1]["domain_weight/solved"] == pytest.approx(1)


def test_difficulty_filter_drops_prompts_without_signal(tmp_path):
    config = _config(tmp_path, train__steps=3, difficulty__samples=4, difficulty__prompts=64)
    summary = run_from_config(config, str(tmp_path / "run"))
    stats = summary["data"]["difficulty"]
    assert stats["estimated"] == 64 and stats["too_easy"] >= 32  # every "solved" prompt
    assert stats["kept"] == 256 - stats["too_easy"] - stats["too_hard"]
    saved = json.loads((tmp_path / "run" / "difficulty.json").read_text())
    assert len(saved["pass_rates"]) == 64
    rows = read_metrics(str(tmp_path / "run"))
    assert len(rows) == 3
