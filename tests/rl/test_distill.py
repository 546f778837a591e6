"""On-policy distillation (`distill.*`): the per-token advantage against NumPy, the teacher's
checks, and a random tiny student pulled toward a teacher (reverse KL falls, greedy exact match
against the teacher's greedy completions on held-out prompts rises)."""

import json

import jax
import numpy as np
import pytest

from posttrain.config import ConfigError
from posttrain.data import load_tokenizer
from posttrain.data._formats import encode_prompt
from posttrain.demo import ASSETS_DIR
from posttrain.losses import distill_advantages
from posttrain.methods import method_config, run_from_config, split_devices
from posttrain.models import Transformer, get_preset, init_params, to_hf
from posttrain.rl import DistillConfig
from posttrain.rl._teacher import teacher_model
from posttrain.sampling import generate
from posttrain.train import load_checkpoint_model, read_metrics
from tests.tolerance import assert_close

from .toy import toy_config

HELD_OUT = 32  # held-out prompts (the demo's eval set) for the exact-match measure
NEW_TOKENS = 6


def matches_teacher(record, completion: str):
    """1 where the greedy completion is the teacher's (the record's "teacher" field)."""
    return float(completion.strip() == record["teacher"].strip()), {}


@pytest.mark.parametrize("per_row", [True, False])
def test_distill_advantages_match_numpy(per_row):
    rng = np.random.default_rng(0)
    B, L = 6, 9
    student = rng.normal(-2.0, 1.0, (B, L)).astype(np.float32)
    teacher = rng.normal(-2.0, 1.0, (B, L)).astype(np.float32)
    mask = (rng.random((B, L)) < 0.7).astype(np.float32)
    # Off the mask the log-probs may hold anything (padding): the advantage is 0 there.
    student[mask == 0] = -np.inf
    teacher[0, mask[0] == 0] = np.nan
    task = rng.normal(size=(B,) if per_row else (B, L)).astype(np.float32)
    got = np.asarray(distill_advantages(student, teacher, mask, task, coef=0.7, reward_coef=0.3))
    task_BL = task[:, None] if per_row else task
    with np.errstate(invalid="ignore"):
        want = np.where(mask > 0, 0.3 * task_BL + 0.7 * (teacher - student), 0.0)
    assert got.shape == (B, L) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # Pure distillation: exactly the negated per-token reverse KL estimate.
    pure = np.asarray(distill_advantages(student, teacher, mask, task, coef=1.0))
    np.testing.assert_array_equal(pure, np.where(mask > 0, teacher - student, 0.0))


def test_config_errors():
    with pytest.raises(ConfigError, match="both 0"):
        DistillConfig(teacher="t", coef=0.0, reward_coef=0.0)
    with pytest.raises(ConfigError, match="without distill.teacher"):
        DistillConfig(teacher_devices=2)
    with pytest.raises(ConfigError, match=">= 0"):
        DistillConfig(teacher="t", coef=-1.0)


def _hf_teacher(path, *, seed: int, sharpen: float = 1.0, **preset) -> str:
    """A random tiny model as an HF directory, its logits scaled by `sharpen` (a decisive
    teacher: near-greedy samples, far from a random student)."""
    config = get_preset("tiny", **preset)
    params = init_params(config, jax.random.key(seed))
    params = {**params, "lm_head": params["lm_head"] * sharpen}
    to_hf(Transformer(params, config), str(path))
    return str(path)


def test_teacher_errors_name_the_fix(tmp_path, devices):
    policy = get_preset("tiny")
    with pytest.raises(ConfigError, match="neither a training workdir"):
        teacher_model(str(tmp_path / "nothing"), policy)
    _, config = method_config(toy_config(distill__teacher="t", distill__teacher_devices=3))
    train, sampler, teacher = split_devices(config, devices)
    assert (train, sampler, teacher) == (devices[:5], None, devices[5:])
    overrides = {"distill__teacher_devices": 4, "rollout__sampler_devices": 4}
    _, config = method_config(toy_config(distill__teacher="t", **overrides))
    with pytest.raises(ConfigError, match="leaves no device to train on"):
        split_devices(config, devices)
    # A teacher with another vocabulary: refused before the run writes anything.
    other = _hf_teacher(tmp_path / "big_vocab", seed=1, vocab_size=1024)
    with pytest.raises(ConfigError, match="vocab_size=1024 but the policy has 512"):
        run_from_config(toy_config(distill__teacher=other), str(tmp_path / "run"))
    assert not (tmp_path / "run" / "prompts.json").exists()


def test_compile_plans_per_token_advantages(devices):
    """`posttrain compile` lowers the step on the batch a distillation run feeds it: per-token
    advantages `[rows, length]` (one per row without a teacher), on the training devices
    only."""
    from posttrain.parallel import make_mesh

    for teacher, per_token in (("", False), ("t", True)):
        method, config = method_config(toy_config(distill__teacher=teacher))
        batch, _, length = method.batch(config, make_mesh(config.mesh, devices))
        rows = config.rows
        assert batch["advantages"].shape == ((rows, length) if per_token else (rows,))
    _, config = method_config(toy_config(distill__teacher="t", distill__teacher_devices=2))
    assert method.devices(config, devices) == devices[:6]


def _held_out(tmp_path, teacher: Transformer) -> dict:
    """The held-out prompts with the teacher's greedy completions, as an eval source whose
    reward is exact match with them."""
    tokenizer = load_tokenizer(str(ASSETS_DIR / "tokenizer"))
    with open(ASSETS_DIR / "eval.jsonl") as f:
        records = [json.loads(line) for _, line in zip(range(HELD_OUT), f, strict=False)]
    ids = [encode_prompt(r, tokenizer) for r in records]
    completions = generate(teacher, tokenizer, ids, max_new_tokens=NEW_TOKENS)
    path = tmp_path / "held_out.jsonl"
    with open(path, "w") as f:
        for r, (c,) in zip(records, completions, strict=True):
            f.write(json.dumps({**r, "domain": "match", "teacher": c.text}) + "\n")
    return {"path": str(path), "weight": 1.0, "domain": "match", "format": "auto"}


def _distill(tmp_path, teacher_path: str, teacher: Transformer, steps: int, **overrides):
    """A random tiny student distilled from `teacher` for `steps` RL steps (pure distillation);
    (metrics per step, held-out exact match at step 0 and at the end)."""
    config = toy_config(
        train__steps=steps,
        rollout__num_generations=4,
        rollout__max_new_tokens=NEW_TOKENS,
        distill__teacher=teacher_path,
        eval_data=[_held_out(tmp_path, teacher)],
        train__eval_every=steps,
        rewards__domains={
            "arithmetic": ["tests.rl.toy:digit_share"],
            "match": ["tests.rl.test_distill:matches_teacher"],
        },
        **overrides,
    )
    run_from_config(config, str(tmp_path / "student"))
    rows = read_metrics(str(tmp_path / "student"))
    evals = read_metrics(str(tmp_path / "student"), split="eval")
    assert [r["step"] for r in evals] == [0, steps]
    return rows, [r["eval_reward/match"] for r in evals]


def test_a_teacher_equal_to_the_student_is_at_reverse_kl_zero(tmp_path):
    """The teacher is the student's own starting weights (an HF export of the same seed's
    init) on its own 4 devices (the student trains on the other 4): its log-probs of the
    sampled tokens are the trainer's, so the first step's reverse KL is 0 up to float
    rounding of log-probs near -6 (a wrong row, target or mesh would be off by ~1)."""
    config = toy_config(train__steps=1, distill__teacher_devices=4)
    seed = config.train.seed
    path = _hf_teacher(tmp_path / "teacher", seed=seed)
    config.distill.teacher = path
    run_from_config(config, str(tmp_path / "student"))
    (row,) = read_metrics(str(tmp_path / "student"))
    assert_close(row["distill/reverse_kl"], 0.0, rtol=0, ulps=8, scale=6.0)
    assert row["logp_gap"] < 1e-3  # (the trainer's pass itself is the sampler's)


@pytest.mark.slow
def test_student_moves_toward_an_sft_teacher(tmp_path):
    """The teacher: a tiny model trained by SFT on the demo task (40 steps: it has learnt the
    answer format, a digit then EOS, and answers "1" to every held-out prompt), read at
    temperature 1/10 (its logits times 10, exported as an HF directory) so that its greedy
    answer is a clear choice. 50 steps of pure distillation pull the random student (random
    tokens up to the budget) to it: the reverse KL falls from ~66 nats per token to under a
    tenth of that, and the student's greedy completions of held-out prompts become the
    teacher's (none to nearly all)."""
    from tests.train.conftest import small_config

    sft = small_config(
        train__steps=40, checkpoint__every=40, data__batch_size=16, optimizer__learning_rate=3e-3
    )
    run_from_config(sft, str(tmp_path / "sft"))
    trained = load_checkpoint_model(str(tmp_path / "sft"))
    params = {**trained.params, "lm_head": trained.params["lm_head"] * 10.0}
    teacher = Transformer(params, trained.config)
    to_hf(teacher, str(tmp_path / "teacher"))
    rows, match = _distill(
        tmp_path, str(tmp_path / "teacher"), teacher, steps=50, optimizer__learning_rate=1e-2
    )
    kl = [r["distill/reverse_kl"] for r in rows]
    assert np.mean(kl[-5:]) < 0.1 * np.mean(kl[:5]), kl
    assert match[0] < 0.1 and match[1] > 0.8, match
