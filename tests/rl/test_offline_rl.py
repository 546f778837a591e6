"""Offline RL from logged trajectories (posttrain/methods/_offline_rl.py,
posttrain/losses/_offline.py): the objectives against NumPy, the logged-row reader, and the stage
raising held-out reward before any online step."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.config import ConfigError
from posttrain.data import load_tokenizer
from posttrain.data._formats import RecordError
from posttrain.demo import ASSETS_DIR
from posttrain.losses import aggregate, awr_loss, truncated_is_loss
from posttrain.methods import (
    LoggedTrajectories,
    logged_advantages,
    method_config,
    offline_rl,
    run_from_config,
)
from posttrain.models import Transformer, init_params
from posttrain.rl import sequence_log_probs
from posttrain.sampling import generate
from posttrain.train import load_checkpoint_model, read_metrics

from .toy import digit_share, toy_config


def _logps(seed=0, shape=(4, 6)):
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.1, 3.0, shape).astype(np.float32)
    mask = (rng.uniform(size=shape) < 0.7).astype(np.float32)
    mask[0] = 0.0  # a row with no completion token counts nowhere
    mask[1, 0] = 1.0
    return logp, mask


def test_awr_weights_loss_and_gradient_match_numpy():
    logp, mask = _logps()
    adv = np.asarray([0.3, -1.0, 0.5, 1e4], np.float32)  # the last would overflow exp()
    beta, cap = 0.5, 5.0

    def loss(lp):
        out = awr_loss(lp, adv, mask, beta=beta, max_weight=cap)
        num, den = aggregate(out["losses"], mask, "seq-mean-token-mean")
        return num / den, out

    (value, out), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logp))
    w = np.minimum(np.exp(np.minimum(adv / beta, 50.0)), cap)
    n = mask.sum(-1)
    rows = n > 0
    expected = np.sum(w[rows] * -(logp * mask).sum(-1)[rows] / n[rows]) / rows.sum()
    np.testing.assert_allclose(np.asarray(out["weights"]), w, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out["clipped"]), [0, 0, 0, 1])
    np.testing.assert_allclose(float(value), expected, rtol=1e-6)
    # d/dlogp_bt = -w_b / n_b / rows on the completion's tokens, 0 elsewhere
    expected_grad = np.where(mask > 0, -w[:, None] / np.maximum(n, 1)[:, None] / rows.sum(), 0)
    np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-6)


def test_truncated_is_loss_matches_numpy():
    logp, mask = _logps(1)
    rng = np.random.default_rng(2)
    behaviour = (logp + rng.normal(0, 0.8, logp.shape)).astype(np.float32)
    adv = np.asarray([1.0, -0.5, 2.0, 0.7], np.float32)
    geometric = np.asarray([0, 0, 1, 0], np.float32)  # row 2 logged only its total
    cap = 1.5

    def loss(lp):
        out = truncated_is_loss(lp, behaviour, adv, mask, cap=cap, geometric_B=geometric)
        num, den = aggregate(out["losses"], mask, "token-mean")
        return num / den, out

    (value, out), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logp))
    ratio = np.exp(logp - behaviour)
    n = mask.sum(-1)
    row_log = ((logp - behaviour) * mask).sum(-1) / np.maximum(n, 1)
    ratio[2] = np.exp(row_log[2])
    w = np.minimum(ratio, cap) * mask
    np.testing.assert_allclose(np.asarray(out["weights"]), w, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(out["clipped"]), (ratio > cap) * mask)
    np.testing.assert_allclose(float(value), np.sum(-w * adv[:, None]) / mask.sum(), rtol=1e-5)
    # the gradient is the truncated-IS policy gradient: -w A on each token, over the tokens
    np.testing.assert_allclose(np.asarray(grad), -w * adv[:, None] / mask.sum(), rtol=1e-5)


def test_logged_advantages_by_group_and_log():
    rewards = np.asarray([1.0, 0.0, 0.5, 1.0, 1.0, 0.2, 0.8])
    groups = ["a", "a", "a", "b", "b", "c", "d"]  # c and d: one row each
    awr = logged_advantages(rewards, groups, scale=False)
    mean = rewards.mean()
    np.testing.assert_allclose(awr, [0.5, -0.5, 0.0, 0.0, 0.0, 0.2 - mean, 0.8 - mean], atol=1e-7)
    grpo = logged_advantages(rewards, groups, scale=True, std_eps=1e-4)
    std_all = rewards.std(ddof=1)
    expected = [0.5 / 0.5001, -0.5 / 0.5001, 0.0, 0.0, 0.0]
    expected += [(0.2 - mean) / (std_all + 1e-4), (0.8 - mean) / (std_all + 1e-4)]
    np.testing.assert_allclose(grpo, expected, rtol=1e-6)


def _config(tmp_path, rows, **overrides):
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    values = {"offline__steps": 2, "offline__data": [str(path)], "offline__batch_size": 4}
    _, config = method_config(toy_config(**{**values, **overrides}))
    return config


def test_logged_rows_are_encoded_with_their_behaviour_logprobs(tmp_path):
    tokenizer = load_tokenizer(ASSETS_DIR / "tokenizer")
    n = len(tokenizer.encode("12 34", add_special_tokens=False)) + 1  # + EOS
    rows = [
        {"prompt": "What is 1 + 1?", "completion": "12 34", "reward": 1.0, "group": 7,
         "logprobs": [-0.5 - 0.1 * i for i in range(n)]},
        {"prompt": "What is 1 + 1?", "completion": "ab", "reward": 0.0, "group": 7,
         "logprob": -4.0},
        {"prompt": [{"role": "user", "content": "Hi"}], "completion": "3", "reward": 0.5,
         "logprob": -1.0},
    ]  # fmt: skip
    config = _config(tmp_path, rows, offline__objective="grpo_is")
    data = LoggedTrajectories(config, tokenizer, rows=3, max_len=40)
    assert data.stats["used"] == 3 and data.stats["groups"] == 1
    batch = data._collate([0, 1, 2])
    first = batch["loss_mask"][0] > 0
    assert first.sum() == n
    np.testing.assert_allclose(batch["behaviour_logps"][0][first], rows[0]["logprobs"], rtol=1e-6)
    second = batch["loss_mask"][1] > 0
    np.testing.assert_allclose(batch["behaviour_logps"][1][second], -4.0 / second.sum(), rtol=1e-6)
    assert batch["geometric"].tolist() == [0.0, 1.0, 1.0]
    # group 7 centres on its own mean (then / its std); the lone chat row on the log's
    np.testing.assert_allclose(batch["advantages"][:2], [0.7071, -0.7071], atol=1e-3)
    assert batch["advantages"][2] == pytest.approx(0.0, abs=1e-6)

    # Parquet rows read the same (absent fields are nulls there)
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {k: [r.get(k) for r in rows[:2]] for k in {**rows[0], **rows[1]}}
    pq.write_table(pa.table(columns), tmp_path / "log.parquet")
    as_parquet = dataclasses.replace(
        config, offline=dataclasses.replace(config.offline, data=(str(tmp_path / "log.parquet"),))
    )
    parquet = LoggedTrajectories(as_parquet, tokenizer, rows=2, max_len=40)._collate([0, 1])
    for key, value in data._collate([0, 1]).items():
        if key != "advantages":  # (the JSONL log also holds the lone chat row)
            np.testing.assert_array_equal(parquet[key], value, err_msg=key)

    bad = [dict(rows[0], logprobs=[-1.0])]
    with pytest.raises(RecordError, match=f"one log-prob per trained completion token \\({n}"):
        LoggedTrajectories(
            _config(tmp_path, bad, data__on_error="raise"), tokenizer, rows=1, max_len=40
        )
    skipped = LoggedTrajectories(_config(tmp_path, bad + rows[1:]), tokenizer, rows=1, max_len=40)
    assert skipped.stats["malformed"] == 1 and skipped.stats["used"] == 2
    plain = [{k: v for k, v in r.items() if k not in ("logprobs", "logprob")} for r in rows]
    with pytest.raises(ConfigError, match="needs the behaviour policy's log-probs"):
        LoggedTrajectories(
            _config(tmp_path, plain, offline__objective="grpo_is"), tokenizer, rows=3, max_len=40
        )
    with pytest.raises(ConfigError, match="needs offline.data"):
        method_config(toy_config(offline__steps=5))


def _mixture(tmp_path, prompts: int = 64, samples: int = 8) -> str:
    """A weak behaviour policy's log of the toy prompts: 6-character completions whose share of
    digits is drawn uniformly (mean reward 0.5), each scored by digit_share."""
    rng = np.random.default_rng(0)
    with open(ASSETS_DIR / "train.jsonl") as f:
        records = [json.loads(line) for _, line in zip(range(prompts), f, strict=False)]
    rows = []
    for record in records:
        for _ in range(samples):
            digits = rng.integers(0, 7)
            chars = list(rng.choice(list("0123456789"), digits))
            chars += list(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 6 - digits))
            text = "".join(rng.permutation(chars))
            rows.append({"prompt": record["prompt"], "completion": text,
                         "reward": digit_share(record, text)[0]})  # fmt: skip
    path = tmp_path / "logged.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _held_out(tmp_path) -> list:
    path = tmp_path / "held_out.jsonl"
    with open(ASSETS_DIR / "train.jsonl") as f:
        path.write_text("".join(line for i, line in enumerate(f) if 1000 <= i < 1032))
    return [{"path": str(path), "weight": 1.0, "domain": "arithmetic", "format": "auto"}]


def _greedy_reward(params, model_config, held_out) -> float:
    """The mean digit_share of greedy completions of the held-out prompts (as the run's eval)."""
    tokenizer = load_tokenizer(ASSETS_DIR / "tokenizer")
    records = [json.loads(line) for line in open(held_out[0]["path"])]
    ids = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True) for r in records]
    out = generate(Transformer(params, model_config), tokenizer, ids, max_new_tokens=6)
    return float(np.mean([digit_share(r, c[0].text)[0] for r, c in zip(records, out, strict=True)]))


def _with_start_logprobs(path: str, config) -> str:
    """The log with `logprobs`: the starting policy's log-prob of each trained token, as if it
    had logged them (the IS ratio of the first update is then exactly 1)."""
    tokenizer = load_tokenizer(ASSETS_DIR / "tokenizer")
    model_config = config.model.model_config()
    params = init_params(model_config, jax.random.key(config.train.seed))
    rows = [json.loads(line) for line in open(path)]
    awr = dataclasses.replace(config, offline=dataclasses.replace(config.offline, objective="awr"))
    data = LoggedTrajectories(awr, tokenizer, rows=len(rows), max_len=40)
    batch = data._collate(list(range(len(rows))))
    logp = np.asarray(sequence_log_probs(params, model_config, batch))
    for row, lp, mask in zip(rows, logp, batch["loss_mask"], strict=True):
        row["logprobs"] = lp[mask > 0].tolist()
    out = path.replace(".jsonl", "_logprobs.jsonl")
    with open(out, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return out


def _stage(tmp_path, objective: str, **overrides) -> dict:
    """Runs the offline stage alone on the weak log; returns its summary, metrics and the
    held-out greedy reward before and after."""
    held_out = _held_out(tmp_path)
    values = {
        "offline__steps": 30,
        "offline__data": [_mixture(tmp_path)],
        "offline__batch_size": 32,
        "offline__learning_rate": 3e-3,
        "offline__objective": objective,
        **overrides,
    }
    _, config = method_config(toy_config(**values))
    if objective == "grpo_is":
        logged = _with_start_logprobs(config.offline.data[0], config)
        _, config = method_config(toy_config(**{**values, "offline__data": [logged]}))
    model_config = config.model.model_config()
    start = _greedy_reward(init_params(model_config, jax.random.key(0)), model_config, held_out)
    continued, summary = offline_rl(config, str(tmp_path / "rl"))
    trained = load_checkpoint_model(continued.model.checkpoint)
    return {
        "start": start,
        "after": _greedy_reward(trained.params, model_config, held_out),
        "summary": summary,
        "config": config,
        "metrics": read_metrics(str(tmp_path / "rl" / "offline")),
    }


@pytest.mark.slow  # ~45 s of CPU: compiling the train step and the sampler dominates
def test_awr_stage_raises_held_out_greedy_reward(tmp_path):
    out = _stage(tmp_path, "awr", offline__beta=0.1)
    assert out["summary"]["final_step"] == 30 and out["summary"]["stopped"] == "completed"
    assert out["after"] > out["start"] + 0.3, out
    first = out["metrics"][0]
    assert 0 < first["ess"] <= 1 and first["weight"] > 0 and first["weight_clipped"] >= 0
    # A finished stage is reused: a second call trains nothing.
    continued, again = offline_rl(out["config"], str(tmp_path / "rl"))
    assert again == {"stopped": "completed", "final_step": 30}
    assert len(read_metrics(str(tmp_path / "rl" / "offline"))) == len(out["metrics"])


@pytest.mark.slow
def test_grpo_is_stage_raises_held_out_greedy_reward(tmp_path):
    out = _stage(tmp_path, "grpo_is")
    first = out["metrics"][0]
    # The behaviour log-probs are the starting policy's: the first update's ratio is 1.
    assert first["ratio"] == pytest.approx(1.0, abs=1e-4) and first["weight_clipped"] == 0
    assert out["after"] > out["start"] + 0.3, out


@pytest.mark.slow
def test_offline_stage_raises_the_runs_eval_reward_before_any_online_step(tmp_path):
    held_out = _held_out(tmp_path)
    offline = {
        "train__steps": 1,
        "eval_data": held_out,
        "offline__steps": 30,
        "offline__data": [_mixture(tmp_path)],
        "offline__batch_size": 32,
        "offline__learning_rate": 3e-3,
        "offline__beta": 0.1,
    }
    run_from_config(toy_config(**offline), str(tmp_path / "offline"))
    run_from_config(toy_config(train__steps=1, eval_data=held_out), str(tmp_path / "start"))
    # Each online run's step-0 eval is its starting policy, before any online update: the
    # random model, or the offline stage's result.
    start = read_metrics(str(tmp_path / "start"), split="eval")[0]
    after = read_metrics(str(tmp_path / "offline"), split="eval")[0]
    assert start["step"] == after["step"] == 0
    assert read_metrics(str(tmp_path / "offline" / "offline"))[-1]["step"] == 30
    assert after["eval_reward"] > start["eval_reward"] + 0.3, (start, after)
