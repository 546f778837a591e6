"""The DPO driver (configs/dpo.py): bad pairs reported, metrics, reference modes, resume."""

import json
import os

import numpy as np
import pytest

from posttrain.config import ConfigError, load_config_file, override
from posttrain.data import PairError
from posttrain.demo import ASSETS_DIR, make_dataset
from posttrain.methods import run_from_config
from posttrain.train import read_metrics

from .conftest import REPO

BAD = [
    {"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "2"},  # identical
    {"prompt": "What is 1 + 2?", "chosen": "", "rejected": "4"},  # empty response
    {"prompt": "What is 1 + 3?", "chosen": "4"},  # missing field
]


def _pairs(records, domain):
    """Demo problems as pairs: the right answer, and a wrong one with a digit appended."""
    return [
        {
            "prompt": r["prompt"],
            "chosen": r["answer"],
            "rejected": r["answer"] + "1",
            "domain": domain,
        }
        for r in records
    ]


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    held_out = make_dataset(64, seed=1)
    train = make_dataset(256, seed=0, exclude=held_out)
    files = {
        "train": [*_pairs(train[:128], "add"), *BAD, *_pairs(train[128:], "sub")],
        "eval": [*_pairs(held_out[:32], "add"), *_pairs(held_out[32:], "sub")],
    }
    for name, records in files.items():
        with open(root / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    return root


def _config(pair_files, file: str = "dpo.py", **overrides):
    """configs/<file>:tiny (dpo.py, or rm.py) on the pair files, shrunk to seconds."""
    config = load_config_file(os.path.join(REPO, "configs", file) + ":tiny")
    source = {
        "path": str(pair_files / "train.jsonl"),
        "weight": 1.0,
        "domain": "x",
        "format": "auto",
    }
    values = {
        "model.checkpoint": "",  # the tiny preset from random init
        **({"loss.sft_weight": 0.0} if file == "dpo.py" else {}),  # plain DPO
        "tokenizer": str(ASSETS_DIR / "tokenizer"),
        "data.sources": [source],
        "eval_data": [{**source, "path": str(pair_files / "eval.jsonl")}],
        "data.max_len": 32,
        "data.batch_size": 16,
        "optimizer.learning_rate": 1e-3,
        "optimizer.warmup_steps": 0,
        "train.steps": 10,
        "train.log_every": 1,
        "train.eval_every": 0,
        "train.progress": False,
        "checkpoint.every": 5,
        "mesh.ici.fsdp": 1,
        "mesh.ici.data": -1,
        **overrides,
    }
    return override(config, values)


def test_dpo_run_reports_bad_pairs_and_learns(pair_files, tmp_path):
    summary = run_from_config(_config(pair_files), str(tmp_path))
    stats = summary["data"]
    assert stats["read"] == 259 and stats["used"] == 256
    assert (stats["identical"], stats["empty"], stats["malformed"]) == (1, 1, 1)
    assert stats["domains"] == {"x": 0, "add": 128, "sub": 128}  # record domains win
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["pairs"]["identical"] == 1

    train = read_metrics(str(tmp_path))
    assert [r["step"] for r in train] == list(range(1, 11))
    first = train[0]
    assert first["loss"] == pytest.approx(np.log(2), abs=1e-5)  # policy == reference at step 1
    assert first["data/skipped"] == 3 and first["data/train/skipped"] == 3  # the BAD records
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "accuracy"):
        assert key in first and np.isfinite(first[key])
    assert any("accuracy/add" in r for r in train) and any("accuracy/sub" in r for r in train)
    assert not any("accuracy/x" in r for r in train)  # no pair of that domain: no metric

    evals = read_metrics(str(tmp_path), "eval")
    final = evals[-1]
    assert final["eval_pairs"] == 64
    assert final["eval_accuracy"] >= 0.9, final  # from 0 (no preference) at step 0
    assert final["eval_accuracy/add"] >= 0.9 and final["eval_accuracy/sub"] >= 0.9
    assert final["eval_loss"] < np.log(2)
    assert os.path.exists(tmp_path / "reference" / "train.process_0.npz")


@pytest.mark.slow  # the loss of both references: tests/train/test_dpo.py (~60 s here)
def test_on_the_fly_and_precomputed_runs_agree(pair_files, tmp_path):
    losses = {}
    for reference in ("on_the_fly", "precomputed"):
        config = _config(pair_files, **{"loss.reference": reference, "train.steps": 3})
        run_from_config(config, str(tmp_path / reference))
        losses[reference] = [r["loss"] for r in read_metrics(str(tmp_path / reference))]
    np.testing.assert_allclose(losses["precomputed"], losses["on_the_fly"], atol=1e-5)


def test_resume_reads_the_stored_reference(pair_files, tmp_path):
    run_from_config(_config(pair_files, **{"train.steps": 5}), str(tmp_path))
    stored = tmp_path / "reference" / "train.process_0.npz"
    before = stored.stat().st_mtime_ns
    run_from_config(_config(pair_files, **{"train.steps": 8}), str(tmp_path))
    assert stored.stat().st_mtime_ns == before
    steps = [r["step"] for r in read_metrics(str(tmp_path))]
    assert steps == list(range(1, 9))


def test_bad_input_raises_with_on_error_raise(pair_files, tmp_path):
    with pytest.raises(PairError, match=r"train.jsonl line 129: .*same tokens"):
        run_from_config(_config(pair_files, **{"data.on_error": "raise"}), str(tmp_path))
    with pytest.raises(ConfigError, match="packing"):
        run_from_config(_config(pair_files, **{"data.packing": True}), str(tmp_path))
    with pytest.raises(ConfigError, match="loss.reference"):
        run_from_config(
            _config(pair_files, **{"loss.type": "simpo", "loss.reference": "on_the_fly"}),
            str(tmp_path),
        )
