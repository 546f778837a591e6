"""Zero-mismatch mode (`model.batch_invariant`): the paged engine's log-probs of the tokens it
sampled equal the trainer's old-policy log-probs bitwise, in bfloat16, on dense and MoE models;
the default mode's gap is measured beside it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.methods import run_from_config
from posttrain.models import ModelConfig, Transformer, get_preset
from posttrain.models._config import MoEConfig
from posttrain.rl._loss import sequence_log_probs
from posttrain.rl._rollout import rollout_batch
from posttrain.sampling import Engine, EngineConfig, generate_continuous
from posttrain.train import read_metrics

from .toy import toy_config


def _gap(config: ModelConfig, *, slots: int, new: int = 24, block_size: int = 16):
    """Samples 3 tokens-id prompts x 4 on the engine (decode batches of `slots` rows), then the
    trainer's `sequence_log_probs` of the same rows: (trainer log-probs, sampler log-probs,
    loss mask), each `[rows, max_len]`."""
    model = Transformer.init(config, 0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, config.vocab_size, size=n).tolist() for n in (5, 19, 33)]
    engine = Engine(model, EngineConfig(slots=slots, block_size=block_size, chunk=5), max_len=64)
    groups = generate_continuous(
        model, None, prompts, max_new_tokens=new, n=4, temperature=1.0, seed=0, engine=engine,
        eos_ids=[],
    )  # fmt: skip
    records = [{"prompt_ids": p, "domain_id": 0} for p in prompts]
    batch = rollout_batch(records, groups, np.zeros((3, 4)), groups=4, max_len=64)
    trainer = jax.jit(lambda p, b: sequence_log_probs(p, config, b))
    logp = trainer(model.params, {k: jnp.asarray(v) for k, v in batch.items()})
    return np.asarray(logp), batch["sampler_logps"], batch["loss_mask"] > 0


@pytest.mark.parametrize("preset", ["tiny", pytest.param("tiny_moe", marks=pytest.mark.slow)])
def test_engine_and_trainer_log_probs_are_bitwise_equal_in_bfloat16(preset):
    default = get_preset(preset, compute_dtype="bfloat16")
    invariant = default.replace(batch_invariant=True)
    # 5 slots for 12 samples: rows join and leave between chunks, so a token is decoded in
    # batches of other sizes and company than the trainer's rows; 8-token pool blocks.
    logp, sampled, mask = _gap(invariant, slots=5, block_size=8)
    assert mask.sum() == 12 * 24
    np.testing.assert_array_equal(logp[mask], sampled[mask])
    # The default mode differs by bfloat16 rounding (measured: mean 5.6e-4, max 2.1e-3 dense;
    # mean 8.3e-4, max 1.2e-2 MoE).
    logp, sampled, mask = _gap(default, slots=5, block_size=8)
    gap = np.abs(logp - sampled)[mask]
    assert 0 < gap.max() < 0.05 and (gap > 0).mean() > 0.5, (gap.mean(), gap.max())


@pytest.mark.parametrize("preset", ["tiny", "tiny_moe"])
def test_the_mode_computes_the_same_model(preset):
    """In float32 the mode's logits are the default's up to float rounding: it changes the
    order of the sums, not what is computed (windows, qk-norm and a shared expert included)."""
    extra = dict(sliding_window=7, sliding_window_layers=(1,), qkv_bias=True)
    if preset == "tiny_moe":
        extra = dict(moe=MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=32, num_shared_experts=1))
    default = get_preset(preset, **extra)
    model = Transformer.init(default, 1)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 512, (3, 37)), jnp.int32)
    want = model(tokens)
    got = Transformer(model.params, default.replace(batch_invariant=True))(tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


@pytest.mark.slow  # ~60 s each on an idle 2-core machine (compiling the tiled layers)
@pytest.mark.parametrize("preset", ["tiny", "tiny_moe"])
def test_grpo_logp_gap_is_float32_ulp_in_bfloat16(preset, tmp_path):
    """A GRPO run in the mode on the 8-device test mesh. Run as a script (one or eight CPU
    devices, -O0 or not) both steps log a gap of exactly 0; under pytest the bfloat16 forward
    still matches but the float32 log-softmax differs by up to one float32 ulp (9.5e-7 at
    |log p| ~ 6, mean 1e-7): the cause is not found yet (docs/rl.md). The default mode's gap
    here is ~5e-4 mean, 2.5e-3 max."""
    config = toy_config(
        "tiny", train__steps=2, model__preset=preset, model__compute_dtype="bfloat16",
        model__batch_invariant=True, rollout__max_prompt_len=64, data__batch_size=4,
        rollout__num_generations=4,
    )  # fmt: skip
    run_from_config(config, str(tmp_path))
    rows = read_metrics(str(tmp_path))
    assert len(rows) == 2 and all(r["groups"] == 4 for r in rows)  # (no prompt too long)
    gaps = [(r["logp_gap"], r["logp_gap_max"]) for r in rows]
    assert all(mean <= 2e-7 and top <= 1e-6 for mean, top in gaps), gaps


def test_bad_settings_are_refused():
    tiny = get_preset("tiny")
    with pytest.raises(ValueError, match="attention='auto'"):
        tiny.replace(batch_invariant=True, attention="flash")
    capacity = MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=32, dispatch="capacity")
    with pytest.raises(ValueError, match="dispatch='dropless'"):
        get_preset("tiny_moe", moe=capacity, batch_invariant=True)
    with pytest.raises(ValueError, match="MLA"):
        get_preset("tiny_mla_moe", batch_invariant=True)
