"""Pipeline parallelism on 8 fake CPU devices: the layer stack split over `stage` (with fsdp,
and data) gives one device's losses and gradients for SFT, DPO and the GRPO loss (GPipe
schedule, microbatches), for dense and MoE models; the 1F1B schedule for SFT and DPO, holding
fewer microbatches' residuals."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.lora import LoRAConfig, Policy, init_adapters
from posttrain.models import get_preset, hidden_states, init_params, param_shardings
from posttrain.models._pipeline import bubble_fraction
from posttrain.parallel import MeshConfig, make_mesh
from posttrain.train import sft_loss
from posttrain.train._step import EXPERT_COUNTS
from tests.lora.test_adapters import _with_random_b
from tests.losses.test_chunked import _sft_batch, close_trees, loss_and_batch, loss_and_grads
from tests.tolerance import assert_close

# Four layers (a sliding window on the first) and rows that split into 4 microbatches of 2.
CONFIG = get_preset(
    "tiny", attention="xla", num_layers=4, sliding_window=24, sliding_window_layers=(0,)
)
ROWS, LENGTH = 8, 32


@pytest.mark.parametrize(
    "method, axes, microbatches, remat, schedule",
    [
        ("sft", {"stage": 2, "fsdp": 4}, 4, "layers", "gpipe"),
        ("sft", {"stage": 4, "fsdp": 2}, 2, "stage", "gpipe"),
        ("dpo", {"stage": 4, "fsdp": 2}, 4, "stage", "gpipe"),
        ("grpo", {"data": 2, "stage": 2, "fsdp": 2}, 2, "layers", "gpipe"),
        ("sft", {"stage": 2, "sequence": 2, "fsdp": 2}, 2, "stage", "gpipe"),
        # 1F1B: 4 microbatches through 3 residual slots; 4 through 7 with only stage inputs
        ("sft", {"stage": 2, "fsdp": 4}, 4, "layers", "1f1b"),
        ("dpo", {"stage": 4, "fsdp": 2}, 4, "stage", "1f1b"),
    ],
    ids=[
        "sft-stage2-fsdp4",
        "sft-stage4-fsdp2-stage_remat",
        "dpo-stage4-fsdp2-stage_remat",
        "grpo-data2-stage2-fsdp2",
        "sft-stage2-sequence2-fsdp2-stage_remat",
        "sft-stage2-fsdp4-1f1b",
        "dpo-stage4-fsdp2-stage_remat-1f1b",
    ],
)
def test_pipelined_losses_equal_one_device(devices, method, axes, microbatches, remat, schedule):
    """Stages with each remat choice and schedule, and stages whose rows are also split along
    their length (ring attention inside a stage), give one device's loss and gradients."""
    config = CONFIG.replace(
        pipeline_microbatches=microbatches, pipeline_remat=remat, pipeline_schedule=schedule
    )
    shape = dict(rows=ROWS, length=LENGTH, seed=3)
    (_, sums0), grads0 = loss_and_grads(method, CONFIG, **shape)
    mesh = make_mesh(MeshConfig.from_dict(axes), devices)
    # The stages pass rows on.
    (_, sums), grads = loss_and_grads(
        method, config, mesh=mesh, collective="collective_permute", **shape
    )
    for name, value in sums0.items():
        assert_close(sums[name], value, rtol=1e-5, err_msg=name)
    close_trees(grads, grads0, rtol=1e-5)


def test_bubble_fraction():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 4) == 3 / 7
    assert bubble_fraction(2, 16) == 1 / 17
    assert bubble_fraction(4, 0) == 3 / 7  # 0: one microbatch per stage


def _step_temporaries(config, mesh, rows, length):
    """Temporary bytes of the compiled SFT loss-and-gradient step on `mesh`."""
    loss, batch = loss_and_batch("sft", np.random.RandomState(0), config, rows, length)
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))

    def objective(params, batch):
        sums = loss(params, batch, None)
        return sums["loss_sum"], sums

    with jax.set_mesh(mesh):
        shardings = param_shardings(config, mesh)
        params = jax.tree.map(
            lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s), params, shardings
        )
        run = jax.jit(jax.value_and_grad(objective, has_aux=True))
        return run.lower(params, batch).compile().memory_analysis().temp_size_in_bytes


def test_one_f_one_b_holds_fewer_microbatches_than_gpipe(devices):
    """With 16 microbatches over 2 stages, GPipe keeps every microbatch's layer residuals until
    its backward, 1F1B at most 3 (2 x stages - 1): its compiled step's temporaries are under
    half of GPipe's."""
    config = CONFIG.replace(num_layers=4, pipeline_microbatches=16, remat="none")
    mesh = make_mesh(MeshConfig.from_dict({"stage": 2, "fsdp": 4}), devices)
    gpipe = _step_temporaries(config, mesh, rows=64, length=64)
    one_f_one_b = _step_temporaries(config.replace(pipeline_schedule="1f1b"), mesh, 64, 64)
    assert one_f_one_b < 0.5 * gpipe, (one_f_one_b, gpipe)


def test_one_f_one_b_refuses_what_it_cannot_run(devices):
    """One clear error each: DPO pairs that do not split into the microbatches (a pair's rows
    run together); bad config values."""
    mesh = make_mesh(MeshConfig.from_dict({"stage": 2, "fsdp": 4}), devices)
    config = CONFIG.replace(pipeline_schedule="1f1b", pipeline_microbatches=8)
    with pytest.raises(ValueError, match="4 pairs do not split into the 1F1B pipeline's 8"):
        loss_and_grads("dpo", config, rows=4, length=LENGTH, mesh=mesh, collective="")
    for field, value, choices in [
        ("pipeline_schedule", "1F1B", "('gpipe', '1f1b')"),
        ("pipeline_remat", "stages", "('layers', 'stage')"),
    ]:
        with pytest.raises(
            ValueError, match=re.escape(f"{field}='{value}'; choose one of {choices}")
        ):
            CONFIG.replace(**{field: value})


# MoE: tiny_moe's 2 expert layers over 2 stages; tiny_mla_moe's first (dense) layer runs as a
# scan before its 2 expert layers are pipelined. The balance and z losses are each
# microbatch's (as over train.micro_batches), so their weights are 0 here: the rest is exact.
@pytest.mark.parametrize(
    "preset, method, remat",
    [("tiny_moe", "sft", "layers"), ("tiny_mla_moe", "dpo", "stage")],
)
def test_pipelined_moe_equals_one_device(devices, preset, method, remat):
    config = get_preset(preset, attention="xla", pipeline_remat=remat, pipeline_microbatches=2)
    shape = dict(rows=ROWS, length=LENGTH, seed=5)
    (_, sums0), grads0 = loss_and_grads(method, config, **shape)
    mesh = make_mesh(MeshConfig.from_dict({"stage": 2, "fsdp": 2, "expert": 2}), devices)
    (_, sums), grads = loss_and_grads(
        method, config, mesh=mesh, collective="collective_permute", **shape
    )
    assert sums0[EXPERT_COUNTS].sum() > 0
    for name, value in sums0.items():
        if name.startswith(("moe/aux_loss", "moe/z_loss")):
            continue  # each microbatch's
        assert_close(sums[name], value, rtol=1e-5, err_msg=name)
    close_trees(grads, grads0, rtol=1e-5)


@pytest.mark.parametrize(
    "preset, method, remat",
    [
        pytest.param("tiny_moe", "sft", "layers", marks=pytest.mark.slow),
        ("tiny_mla_moe", "dpo", "stage"),
    ],
)
def test_one_f_one_b_moe_equals_gpipe(devices, preset, method, remat):
    """With balance and z losses in the objective (each microbatch's, as under GPipe), 1F1B
    takes their gradients inside its schedule: losses, expert counts and gradients equal
    GPipe's (whose autodiff is the reference: the balance losses move tiny_moe's gradients
    by up to 0.8 here)."""
    config = get_preset(preset, attention="xla", pipeline_remat=remat, pipeline_microbatches=2)
    moe = dataclasses.replace(config.moe, aux_loss_coef=0.1, router_z_loss_coef=0.01)
    config = config.replace(moe=moe)
    shape = dict(rows=ROWS, length=LENGTH, seed=5)
    mesh = make_mesh(MeshConfig.from_dict({"stage": 2, "fsdp": 2, "expert": 2}), devices)
    kwargs = dict(mesh=mesh, collective="collective_permute", **shape)
    (_, sums0), grads0 = loss_and_grads(method, config, **kwargs)
    (_, sums), grads = loss_and_grads(method, config.replace(pipeline_schedule="1f1b"), **kwargs)
    assert sums0["moe/aux_loss_sum"] > 0
    for name, value in sums0.items():
        assert_close(sums[name], value, rtol=1e-5, err_msg=name)
    close_trees(grads, grads0, rtol=1e-5)


def test_pipelined_moe_routing_is_each_rows_own(devices):
    """The router's choices come back per row in row order (row r ran in microbatch r mod M),
    and the balance loss is the microbatches' mean of their own."""
    config = get_preset("tiny_moe", attention="xla", pipeline_microbatches=4)
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, config.vocab_size, (ROWS, LENGTH)).astype(np.int32)
    params = init_params(config, jax.random.key(0))
    run = jax.jit(lambda p, t: hidden_states(p, t, config, return_aux=True)[1])
    whole = run(params, tokens)
    mean_of_microbatches = np.mean([run(params, tokens[m::4])["aux_loss"] for m in range(4)])
    mesh = make_mesh(MeshConfig.from_dict({"stage": 2, "fsdp": 4}), devices)
    with jax.set_mesh(mesh):
        piped = run(jax.device_put(params, param_shardings(config, mesh)), tokens)
    np.testing.assert_array_equal(piped["routed_experts"], whole["routed_experts"])
    np.testing.assert_array_equal(piped["expert_counts"], whole["expert_counts"])
    assert_close(piped["aux_loss"], mean_of_microbatches, rtol=1e-5)


def test_one_f_one_b_trains_lora_adapters_on_a_frozen_base(devices):
    """LoRA under 1F1B: the adapters' gradients equal one device's, with the frozen base (an
    input the schedule neither differentiates nor stores per microbatch) held once."""
    config = CONFIG.replace(pipeline_microbatches=4)
    lora = LoRAConfig(rank=4, targets=(".",))
    base = init_params(config, jax.random.key(0))
    adapters = _with_random_b(init_adapters(config, lora, jax.random.key(1)))
    batch = _sft_batch(np.random.RandomState(0), ROWS, LENGTH)

    def grads(config, base, adapters):
        loss = lambda a, base: sft_loss(config, 1e-3, policy=Policy(lora, base))(a, batch, None)  # noqa: E731
        return jax.jit(jax.grad(lambda a, base: loss(a, base)["loss_sum"]))(adapters, base)

    expected = grads(config, base, adapters)
    mesh = make_mesh(MeshConfig.from_dict({"stage": 2, "fsdp": 4}), devices)
    with jax.set_mesh(mesh):
        base = jax.device_put(base, param_shardings(config, mesh))
        got = grads(config.replace(pipeline_schedule="1f1b"), base, adapters)
    close_trees(got, expected, rtol=1e-5)


def test_a_stages_saved_residuals_leave_out_its_weights():
    """What 1F1B keeps per microbatch slot: the stage VJP's leaves less the stage's weights,
    trained ones (arguments) and frozen ones it closes over (LoRA's base) alike; a backward
    rebuilt from one microbatch's VJP structure and another's saved residuals is that other
    microbatch's VJP (the schedule's use)."""
    from posttrain.models._pipeline import _residuals, _with_residuals

    layers, width = 3, 16
    keys = jax.random.split(jax.random.key(0), 4)
    base = jax.random.normal(keys[0], (layers, width, width))
    trained = jax.random.normal(keys[1], (layers, width, width)) * 0.1
    h_a, h_b = jax.random.normal(keys[2], (4, width)), jax.random.normal(keys[3], (4, width))

    def check(trained, base, h_a, h_b):
        def stage(trained, h):
            def layer(h, ws):
                return jnp.tanh(h @ (ws[0] + ws[1])), None

            layer = jax.checkpoint(layer, prevent_cse=False)  # as a layer's remat
            return jax.lax.scan(layer, h, (base, trained))[0]

        held = [trained, base]
        y, vjp_a = jax.vjp(stage, trained, h_a)
        _, structure = _residuals(vjp_a, held)
        _, vjp_b = jax.vjp(stage, trained, h_b)
        saved_b, _ = _residuals(vjp_b, held)
        assert saved_b and all(a.shape != base.shape for a in saved_b)  # no weight per slot
        ct = jnp.ones_like(y)
        return _with_residuals(structure, held, saved_b)(ct), vjp_b(ct), vjp_a(ct)

    rebuilt, expected, other = jax.jit(check)(trained, base, h_a, h_b)
    close_trees(rebuilt, expected, rtol=1e-6)
    assert not np.allclose(rebuilt[0], other[0])  # (microbatch a's would differ)
