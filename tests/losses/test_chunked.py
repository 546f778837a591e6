"""Chunked vocabulary statistics (`token_stats`, `ModelConfig.logits_chunk`): every method's loss
and gradients equal the ones over full `[B, L, V]` logits, and the compiled step never holds
those logits."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain import methods
from posttrain.config import load_config_file, override
from posttrain.losses import logit_stats, token_stats
from posttrain.models import get_preset, init_params, lm_logits, param_shardings
from posttrain.rl import PolicyLossConfig, rl_loss
from posttrain.train import dpo_loss, sft_loss
from tests.tolerance import assert_close

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIG = get_preset("tiny", attention="xla")
B, L = 3, 37  # 37 positions: no chunk size below divides it


def close_trees(a, b, *, rtol, ulps=16, err_msg=""):
    """Leaf by leaf, with an absolute slack of a few ulps of each leaf's largest value (a
    gradient summed in another order over positions)."""
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True
    ):
        assert_close(x, y, rtol=rtol, ulps=ulps, scale=np.abs(y).max(), err_msg=f"{err_msg}{path}")


@pytest.mark.parametrize(
    "tie", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["lm_head", "tied"]
)
def test_token_stats_equal_the_full_logits(tie):
    config = CONFIG.replace(tie_embeddings=tie)
    params = init_params(config, jax.random.key(0))
    params = {k: params[k] for k in ("embed", "lm_head") if k in params}
    rng = np.random.RandomState(0)
    hidden = jnp.asarray(rng.randn(B, L, config.embed_dim), jnp.float32)
    targets = rng.randint(0, config.vocab_size, (B, L))
    best = np.asarray(jnp.argmax(lm_logits(params, hidden, config), -1))
    targets = jnp.asarray(np.where(rng.rand(B, L) < 0.5, best, targets), jnp.int32)  # hits too
    weights = jnp.asarray(rng.randn(4, B, L), jnp.float32)

    def objective(params, hidden, chunk):
        stats = token_stats(
            params, hidden, targets, config.replace(logits_chunk=chunk), entropy=True
        )
        terms = [stats["logp"], stats["entropy"], jnp.square(stats["log_z"]), stats["correct"]]
        return sum(jnp.sum(w * t) for w, t in zip(weights, terms, strict=True)), stats

    run = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True), static_argnums=2)
    (_, full), full_grads = run(params, hidden, 0)
    reference = logit_stats(lm_logits(params, hidden, config), targets, entropy=True)
    for name, value in reference.items():
        assert_close(full[name], value, rtol=1e-6, err_msg=name)
    assert 0 < float(full["correct"].sum()) < B * L
    for chunk in (1, 5, 8, 36, 37, 64):
        (_, stats), grads = run(params, hidden, chunk)
        for name, value in full.items():
            assert_close(stats[name], value, rtol=1e-6, err_msg=f"chunk {chunk}: {name}")
        close_trees(grads, full_grads, rtol=1e-6, err_msg=f"chunk {chunk}: ")


def _sft_batch(rng, rows=B, length=L):
    segments = np.ones((rows, length), np.int32)
    segments[0, length // 2 :] = 2  # a packed row: two documents
    positions = np.tile(np.arange(length, dtype=np.int32), (rows, 1))
    positions[0, length // 2 :] -= length // 2
    return {
        "tokens": rng.randint(3, CONFIG.vocab_size, (rows, length)).astype(np.int32),
        "targets": rng.randint(3, CONFIG.vocab_size, (rows, length)).astype(np.int32),
        "loss_mask": (rng.rand(rows, length) < 0.7).astype(np.float32),
        "positions": positions,
        "segment_ids": segments,
    }


def loss_and_batch(method: str, rng, config, rows: int = B, length: int = L):
    """A method's loss function over `config` and a random batch for it (a packed first row;
    GRPO: off-policy old log-probs, a reference, an entropy bonus, importance truncation)."""
    if method == "sft":
        return sft_loss(config, z_loss=1e-3), _sft_batch(rng, rows, length)
    if method == "dpo":
        chosen, rejected = _sft_batch(rng, rows, length), _sft_batch(rng, rows, length)
        batch = {f"chosen_{k}": v for k, v in chosen.items()}
        batch |= {f"rejected_{k}": v for k, v in rejected.items()}
        batch["ref_chosen_logps"] = -rng.rand(rows).astype(np.float32) * 50
        batch["ref_rejected_logps"] = -rng.rand(rows).astype(np.float32) * 50
        batch["domain_ids"] = np.zeros(rows, np.int32)
        return dpo_loss(config, reference="precomputed"), batch
    batch = _sft_batch(rng, rows, length)
    mask, shape = batch["loss_mask"], (rows, length)
    logps = -rng.rand(*shape).astype(np.float32) * 6 * mask
    batch |= {
        "old_logps": logps + 0.3 * rng.randn(*shape).astype(np.float32) * mask,
        "sampler_logps": logps,
        "ref_logps": logps + 0.2 * rng.randn(*shape).astype(np.float32) * mask,
        "advantages": rng.randn(rows).astype(np.float32),
        "kl_coefs": np.full(rows, 0.05, np.float32),
        "truncated": np.zeros(rows, np.float32),
        "domain_ids": np.zeros(rows, np.int32),
    }
    loss_config = PolicyLossConfig(entropy_coef=0.01, correction="token", tis_cap=2.0)
    return rl_loss(config, loss_config, max_new_tokens=length, use_reference=True), batch


def loss_and_grads(method, config, *, rows=B, length=L, seed=2, mesh=None, collective=None):
    """((loss, sums), gradients) of a method's loss (`loss_and_batch`) at random params, on one
    device or sharded over `mesh` (whose lowered program must then contain `collective`)."""
    loss, batch = loss_and_batch(method, np.random.RandomState(seed), config, rows, length)
    params = init_params(config, jax.random.key(seed - 1))

    def objective(params, batch):
        sums = loss(params, batch, None)
        return sums["loss_sum"], sums

    run = jax.jit(jax.value_and_grad(objective, has_aux=True))
    if mesh is None:
        return jax.device_get(run(params, batch))
    with jax.set_mesh(mesh):
        params = jax.device_put(params, param_shardings(config, mesh))
        assert collective in run.lower(params, batch).as_text()
        return jax.device_get(run(params, batch))


@pytest.mark.parametrize("method", ["sft", "dpo", "grpo"])
def test_every_methods_loss_is_unchanged_by_chunking(method):
    """The loss sums (each metric numerator) and their gradients with 8-position chunks equal
    the ones over the full logits."""
    (_, sums0), grads0 = loss_and_grads(method, CONFIG)
    (_, sums), grads = loss_and_grads(method, CONFIG.replace(logits_chunk=8))
    assert set(sums) == set(sums0)
    for name, value in sums0.items():
        assert_close(sums[name], value, rtol=1e-6, err_msg=name)
    close_trees(grads, grads0, rtol=1e-6)


def _compiled_sft_step_memory(length: int) -> int:
    """Temporary bytes of the compiled SFT step of the `tiny_long` preset (32k vocabulary,
    flash attention, 1024-position logits chunks) on one row of `length` tokens."""
    config = override(
        load_config_file(os.path.join(REPO, "configs", "sft.py:tiny")),
        {"model.preset": "tiny_long", "data.max_len": length, "data.batch_size": 1,
         "model.remat": "full"},
    )  # fmt: skip
    low = methods.lowering(config, jax.devices()[:1])
    with jax.set_mesh(low.mesh):
        return low.jitted().lower(*low.arguments()).compile().memory_analysis().temp_size_in_bytes


def test_a_long_sft_step_never_holds_the_full_logits():
    """At L = 32k and V = 32k the `[1, L, V]` float32 logits alone are 4 GiB; the compiled step
    allocates less than an eighth of that (how it grows with L:
    benchmarks/long_context_memory.py)."""
    temporaries = _compiled_sft_step_memory(32_768)
    assert temporaries < 32_768 * 32_768 * 4 / 8, temporaries
