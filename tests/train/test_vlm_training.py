"""A tiny vision-language model learns the synthetic shapes task (posttrain.demo._shapes: how
many shapes an image holds): SFT on image-text chats takes greedy accuracy from chance to
near-perfect, GRPO on image prompts then raises its sampled reward, and DPO on image-grounded
pairs teaches a model that does not look yet to tell the right count from a wrong one (seeded
runs)."""

import os
import shutil

import numpy as np
import pytest

from posttrain.config import load_config_file, override
from posttrain.demo._shapes import greedy_accuracy, sampled_accuracy, write_task
from posttrain.methods import run_from_config
from posttrain.train import load_checkpoint_model, read_metrics
from tests.train.conftest import REPO

RUN = {
    "train.log_every": 1,
    "train.eval_every": 0,
    "train.progress": False,
    "mesh.ici.fsdp": 1,
    "mesh.ici.data": -1,
    "model.preset": "tiny_vlm",
}


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    return write_task(root, n_train=1500, n_eval=48, seed=0, questions=("count",))


def _config(file: str, preset: str, task: dict, values: dict):
    config = load_config_file(os.path.join(REPO, "configs", file) + f":{preset}")
    config.eval_data = []
    return override(config, {**RUN, "tokenizer": task["tokenizer"], **values})


def accuracy(model, task: dict, path: str) -> float:
    return greedy_accuracy(model, task["tokenizer"], path)


@pytest.fixture(scope="module")
def sft(task, tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("vlm_sft"))
    config = _config("sft.py", "tiny", task, {
        "data.sources": [{"path": task["train"], "weight": 1.0, "domain": "shapes",
                          "format": "auto"}],
        "data.max_len": 64, "data.batch_size": 16, "train.steps": 200,
        "optimizer.learning_rate": 3e-3, "optimizer.warmup_steps": 5,
        "checkpoint.every": 100, "checkpoint.keep_last": 5,
    })  # fmt: skip
    run_from_config(config, workdir)
    return workdir


def test_sft_teaches_the_visual_task(sft, task):
    """Answering without looking (the most common count) is right about a third of the time;
    the model that looks at the images is right almost always (1.0 measured)."""
    halfway, end = load_checkpoint_model(sft, 100), load_checkpoint_model(sft)
    before, after = accuracy(halfway, task, task["eval"]), accuracy(end, task, task["eval"])
    print(f"greedy accuracy after 100 steps {before:.2f}, after 200 {after:.2f}")
    assert before < 0.5 and after >= 0.8
    losses = [r["loss"] for r in read_metrics(sft, "train")]
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[50:60])  # (0.19 vs 0.70 measured)


def test_grpo_with_image_prompts_raises_the_reward(sft, task, tmp_path):
    """From the SFT model, GRPO on the count questions' image prompts (the integer verifier of
    domain "arithmetic" scores them), its image encoder frozen, sharpens its sampled answers:
    8 samples of each held-out question (the same seeds before and after) are right more
    often. (Per-step training rewards cover other prompts each step: too noisy to compare.)"""
    workdir = str(tmp_path / "grpo")
    config = _config("grpo.py", "tiny", task, {
        "model.checkpoint": sft, "model.freeze": ["vision/(patch|position|layers)"],
        "data.sources": [{"path": task["prompts"], "weight": 1.0, "domain": "arithmetic",
                          "format": "auto"}],
        "data.batch_size": 8, "rollout.num_generations": 8, "rollout.max_prompt_len": 32,
        "rollout.max_new_tokens": 3, "train.steps": 50, "optimizer.learning_rate": 3e-4,
        "optimizer.warmup_steps": 10, "checkpoint.every": 50,
    })  # fmt: skip
    run_from_config(config, workdir)
    trained, start = load_checkpoint_model(workdir).params, load_checkpoint_model(sft).params
    for name in ("patch", "position"):
        np.testing.assert_array_equal(trained["vision"][name], start["vision"][name])
    assert not np.array_equal(
        trained["vision"]["projector"]["fc1"], start["vision"]["projector"]["fc1"]
    )
    rewards = [r["reward"] for r in read_metrics(workdir, "train")]
    print("rewards", np.round(rewards, 2).tolist())
    before = sampled_accuracy(load_checkpoint_model(sft), task["tokenizer"], task["eval"])
    after = sampled_accuracy(load_checkpoint_model(workdir), task["tokenizer"], task["eval"])
    print(f"sampled accuracy (8 per question) {before:.3f} -> {after:.3f}")
    assert after > before + 0.05
    assert accuracy(load_checkpoint_model(workdir), task, task["eval"]) >= 0.8


@pytest.mark.slow  # ~70 s here (SFT and GRPO, above, run in the default suite)
def test_dpo_on_image_pairs_learns_to_look(sft, task, tmp_path):
    """From the SFT model at 100 steps (it answers without looking: a third right), DPO on
    pairs of the right count and a wrong one: a model blind to the images would prefer the
    right one of held-out pairs half the time; after 60 steps it does 0.88 of the time (0.71
    at 30)."""
    start = str(tmp_path / "sft_100")
    shutil.copytree(sft, start)
    shutil.rmtree(os.path.join(start, "checkpoints", "200"))
    source = lambda path: [{"path": path, "weight": 1.0, "domain": "shapes", "format": "auto"}]  # noqa: E731
    config = _config("dpo.py", "tiny", task, {
        "model.checkpoint": start, "data.sources": source(task["pairs_train"]),
        "data.max_len": 32, "data.batch_size": 16, "train.steps": 60,
        "optimizer.learning_rate": 1e-3, "train.eval_every": 30, "checkpoint.every": 60,
    })  # fmt: skip
    config.eval_data = source(task["pairs_eval"])
    workdir = str(tmp_path / "dpo")
    run_from_config(config, workdir)
    accuracies = [r["eval_accuracy"] for r in read_metrics(workdir, "eval")]
    print("held-out preference accuracy", accuracies)
    assert accuracies[-1] >= 0.75 and accuracies[-1] > accuracies[0]
