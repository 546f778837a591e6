"""LoRA SFT learns the demo task on the tiny model's random-init frozen base: greedy exact match
on the held-out problems rises above the base's, and the base stays bitwise unchanged.

Slow (about 2 minutes on 2 CPU cores): `make test-slow`.
"""

import json

import jax
import numpy as np
import pytest

from posttrain.data import load_tokenizer
from posttrain.demo import ASSETS_DIR
from posttrain.eval import greedy_exact_match
from posttrain.methods import run_from_config
from posttrain.models import Transformer, init_params
from posttrain.train import load_checkpoint_model
from tests.train.conftest import small_config

pytestmark = pytest.mark.slow

# The cheapest setup measured to learn exact match (500 held-out problems, the base scores 0.000
# in every run). The frozen random lm_head (std 0.02) caps the logits near +-1.3, so the loss
# stays above 5 nats and learning is slow: with these settings train.seed/data.seed 0, 1, 2
# reach 0.098, 0.156, 0.110. lr 1e-3 / 3e-3 / 5e-3 reach 0.078 / 0.078 / 0.014 (5e-3
# diverges); rank 8 (alpha 16) 0.058, rank 32 (alpha 64) 0.090; 1000 steps 0.042.
LORA = {
    "lora__enabled": True,
    "lora__rank": 16,
    "lora__alpha": 32.0,
    "optimizer__learning_rate": 2e-3,
    "optimizer__warmup_steps": 20,
    "train__steps": 1600,
    "train__log_every": 100,
    "data__max_len": 128,
    "data__batch_size": 16,
    "checkpoint__every": 1600,
}
# Measured 0.096 to 0.156 across seeds, and 0.202 for seed 0 after `a` became [*lead, r, *in]
# (same draws, another matmul order: the runs are that sensitive); about half the lowest.
MIN_ACCURACY = 0.05
MAX_BASE_ACCURACY = 0.01  # measured 0.000


def test_lora_beats_the_base_on_held_out_exact_match_and_leaves_it_bitwise(tmp_path, devices):
    # (one test, not a module fixture shared by two: xdist would train it on both workers)
    config = small_config(**LORA)
    summary = run_from_config(config, str(tmp_path))
    fresh = init_params(summary["model_config"], jax.random.key(config.train.seed))
    for x, y in zip(jax.tree.leaves(summary["base_params"]), jax.tree.leaves(fresh), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    tokenizer = load_tokenizer(config.tokenizer)
    with open(ASSETS_DIR / "eval.jsonl") as f:
        held_out = [json.loads(line) for line in f if line.strip()]
    base = Transformer(jax.device_get(summary["base_params"]), summary["model_config"])
    base_accuracy = float(greedy_exact_match(base, tokenizer, held_out).mean())
    merged = load_checkpoint_model(str(tmp_path))
    accuracy = float(greedy_exact_match(merged, tokenizer, held_out).mean())
    assert len(held_out) == 500
    assert base_accuracy <= MAX_BASE_ACCURACY, base_accuracy
    assert accuracy >= max(MIN_ACCURACY, base_accuracy + MIN_ACCURACY), (accuracy, base_accuracy)
