"""The RL loss in the shared train step: split-invariance, sampler/trainer agreement, direction."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from posttrain.models import Transformer, get_preset
from posttrain.parallel import MeshConfig, make_mesh, shard_batch
from posttrain.rl import PolicyLossConfig, rl_loss, rollout_batch, sequence_log_probs
from posttrain.sampling import generate
from posttrain.train import create_state, train_step
from tests.tolerance import assert_close, ulp

CONFIG = get_preset("tiny", attention="xla")
MAX_NEW = 6


@pytest.fixture(scope="module")
def rollouts():
    """16 sampled rows (4 prompts x 4) of a random tiny model, with the trainer's log-probs."""
    model = Transformer.init(CONFIG, rng=0)
    rng = np.random.RandomState(0)
    prompts = [
        {"prompt_ids": list(rng.randint(3, 500, 3 + i)), "domain_id": i % 2} for i in range(4)
    ]
    completions = generate(
        model, None, [p["prompt_ids"] for p in prompts], max_new_tokens=MAX_NEW,
        temperature=1.0, n=4, seed=1, eos_ids=(2,),
    )  # fmt: skip
    batch = rollout_batch(prompts, completions, rng.rand(4, 4), groups=4, max_len=12)
    logps = np.asarray(jax.jit(sequence_log_probs, static_argnums=1)(model.params, CONFIG, batch))
    return model, batch, logps


def test_trainer_matches_sampler_log_probs(rollouts):
    _, batch, logps = rollouts
    mask = batch["loss_mask"] > 0
    gap = np.abs(logps - batch["sampler_logps"])[mask]
    assert mask.sum() >= 40 and gap.mean() < 1e-3, gap.mean()


def _inputs(batch, logps):
    rng = np.random.RandomState(1)
    mask = batch["loss_mask"]
    return {
        **batch,
        # Off-policy by a little, so that ratios move and some tokens clip.
        "old_logps": (logps + 0.3 * rng.randn(*logps.shape) * mask).astype(np.float32),
        "ref_logps": (logps + 0.2 * rng.randn(*logps.shape) * mask).astype(np.float32),
        "advantages": rng.randn(len(mask)).astype(np.float32),
        "kl_coefs": np.full(len(mask), 0.05, np.float32),
    }


@pytest.mark.parametrize(
    "aggregation",
    [  # ~25 s each; the other two in `make test-slow`
        "token-mean",
        pytest.param("seq-mean-token-mean", marks=pytest.mark.slow),
        pytest.param("seq-mean-token-sum-norm", marks=pytest.mark.slow),
    ],
)
def test_loss_and_gradients_do_not_depend_on_the_split(rollouts, aggregation, devices):
    model, batch, logps = rollouts
    inputs = _inputs(batch, logps)
    loss_config = PolicyLossConfig(aggregation=aggregation, clip_high=0.28, dual_clip=3.0)
    loss = rl_loss(
        CONFIG, loss_config, max_new_tokens=MAX_NEW, use_reference=True, domains=("a", "b")
    )
    sgd = optax.sgd(1.0)
    results = []
    for data, micro in ((1, 1), (8, 2), (4, 4)):  # one device; data-parallel, micro-batched
        mesh = make_mesh(MeshConfig.from_dict({"data": data, "fsdp": 1}), jax.devices()[:data])
        with jax.set_mesh(mesh):
            state = create_state(jax.tree.map(jnp.copy, model.params), sgd, seed=0)
            step = jax.jit(
                functools.partial(train_step, loss_fn=loss, optimizer=sgd, micro_batches=micro)
            )
            new, metrics = step(state, shard_batch(inputs, mesh))
        results.append((jax.device_get(metrics), jax.device_get(new.params)))
    (m0, p0), *others = results
    assert 0 < float(m0["clip_fraction"]) < 1 and float(m0["kl"]) > 0
    for m, p in others:
        # The metrics are means of terms of order 1 (ratios x unit advantages, log-probs):
        # a few ulps of 1 absolute, 2e-5 relative for the reordered sums.
        for name in ("loss", "grad_norm", "kl", "clip_fraction", "entropy", "kl/a", "kl/b"):
            assert_close(m[name], m0[name], rtol=2e-5, scale=1.0, err_msg=name)
        # With SGD at lr 1, new params = params - grad. Each subtraction rounds to half an ulp of
        # the parameter, so the update carries ulps of the parameters (~1), not of the ~1e-5
        # updates; the grads themselves are reordered sums, exact to ~1e-5 of the leaf's largest
        # gradient (the size of the terms summed) and 1e-4 relative.
        old_params = jax.device_get(model.params)
        for a, b, old in zip(*map(jax.tree.leaves, (p, p0, old_params)), strict=True):
            update = b - old
            atol = 2 * ulp(old) + 1e-5 * np.abs(update).max()
            np.testing.assert_allclose(a - old, update, rtol=1e-4, atol=atol)


def test_update_raises_the_log_prob_of_a_positive_advantage(rollouts):
    model, batch, logps = rollouts
    inputs = {**_inputs(batch, logps), "old_logps": logps}
    advantages = np.zeros(16, np.float32)
    advantages[0], advantages[5] = 1.0, -1.0
    inputs["advantages"] = advantages
    loss = rl_loss(CONFIG, PolicyLossConfig(), max_new_tokens=MAX_NEW, use_reference=False)
    sgd = optax.sgd(0.05)
    state = create_state(jax.tree.map(jnp.copy, model.params), sgd, seed=0)
    new, _ = jax.jit(functools.partial(train_step, loss_fn=loss, optimizer=sgd))(state, inputs)
    after = np.asarray(jax.jit(sequence_log_probs, static_argnums=1)(new.params, CONFIG, batch))
    mask = batch["loss_mask"] > 0
    total = lambda lp, r: float(lp[r][mask[r]].sum())
    assert total(after, 0) > total(logps, 0) and total(after, 5) < total(logps, 5)


def test_fused_old_log_probs_give_the_separate_pass_update(rollouts):
    """`fused_old_logps` (one update per batch) takes the old log-probs from the update's own
    forward: the same update as a separate pass's log-probs, and the same logp_gap metrics
    (logp_gap_max kept as the largest over micro-batches)."""
    model, batch, logps = rollouts
    inputs = {**_inputs(batch, logps), "old_logps": logps}
    sgd = optax.sgd(1.0)
    results = []
    for fused in (False, True):
        loss = rl_loss(CONFIG, PolicyLossConfig(), max_new_tokens=MAX_NEW, use_reference=True,
                       fused_old_logps=fused)  # fmt: skip
        data = {k: v for k, v in inputs.items() if not (fused and k == "old_logps")}
        state = create_state(jax.tree.map(jnp.copy, model.params), sgd, seed=0)
        step = functools.partial(train_step, loss_fn=loss, optimizer=sgd, micro_batches=2)
        new, metrics = jax.jit(step)(state, data)
        results.append((jax.device_get(metrics), jax.device_get(new.params)))
    (m0, p0), (m1, p1) = results
    for name in ("loss", "grad_norm", "kl", "ratio", "logp_gap", "entropy"):
        assert_close(m1[name], m0[name], rtol=2e-5, scale=1.0, err_msg=name)
    gap = np.abs(logps - batch["sampler_logps"])[batch["loss_mask"] > 0]
    assert_close(m1["logp_gap_max"], gap.max(), rtol=1e-3, scale=1.0)
    assert "logp_gap_max" not in m0  # (the separate pass's runs log it from the host batch)
    for a, b, old in zip(*map(jax.tree.leaves, (p1, p0, jax.device_get(model.params))),
                         strict=True):  # fmt: skip
        update = b - old
        np.testing.assert_allclose(a - old, update, rtol=1e-4,
                                   atol=2 * ulp(old) + 1e-5 * np.abs(update).max())  # fmt: skip
