"""The calculator task's warm-started tiny model, trained once per session and shared by the
tests that need a model which calls tools (GRPO on the calculator, the episode endpoint)."""

import os

import jax
import pytest

from posttrain.config import build, load_config_file, override
from posttrain.demo._calculator import build_calculator_assets
from posttrain.models import Transformer, get_preset
from posttrain.train import SFTConfig, run_sft
from posttrain.train._params import restore_params

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SFT_STEPS = 200  # enough to learn the call format, not to copy every digit reliably


def load_policy(workdir: str) -> Transformer:
    """The latest params of a run of the tiny model, on the default device."""
    config = get_preset("tiny")
    abstract = jax.eval_shape(lambda: Transformer.init(config, 0).params)
    return Transformer(jax.device_put(restore_params(workdir, abstract)), config)


@pytest.fixture(scope="session")
def calculator_sft(tmp_path_factory):
    """{"workdir": the SFT run, "tokenizer", "train", "eval", "sft": asset paths}."""
    root = tmp_path_factory.mktemp("calculator")
    assets = build_calculator_assets(
        root / "assets", n_train=512, n_eval=32, n_sft=1024, tool_share=1.0
    )
    source = {"path": assets["sft"], "weight": 1.0, "domain": "calculator", "format": "auto"}
    values = {
        "tokenizer": assets["tokenizer"],
        "data.sources": [source],
        "train.steps": SFT_STEPS,
        "train.progress": False,
        "checkpoint.every": SFT_STEPS,
        "checkpoint.async_save": False,
    }
    config = override(
        load_config_file(os.path.join(REPO, "configs", "agent.py:calculator_sft")), values
    )
    workdir = str(root / "sft")
    run_sft(build(SFTConfig, {k: v for k, v in config.items() if k != "method"}), workdir)
    return {"workdir": workdir, **assets}
