"""Pipeline parallelism on 8 fake CPU devices: the layer stack split over `stage` (with fsdp,
and data) gives one device's losses and gradients for SFT, DPO and the GRPO loss (GPipe
schedule, microbatches), for dense and MoE models."""

import jax
import numpy as np
import pytest

from posttrain.models import get_preset, hidden_states, init_params, param_shardings
from posttrain.models._pipeline import bubble_fraction
from posttrain.parallel import MeshConfig, make_mesh
from posttrain.train._step import EXPERT_COUNTS
from tests.losses.test_chunked import close_trees, loss_and_grads
from tests.tolerance import assert_close

# Four layers (a sliding window on the first) and rows that split into 4 microbatches of 2.
CONFIG = get_preset(
    "tiny", attention="xla", num_layers=4, sliding_window=24, sliding_window_layers=(0,)
)
ROWS, LENGTH = 8, 32


@pytest.mark.parametrize(
    "method, axes, microbatches, remat",
    [
        ("sft", {"stage": 2, "fsdp": 4}, 4, "layers"),
        ("sft", {"stage": 4, "fsdp": 2}, 2, "stage"),
        ("dpo", {"stage": 4, "fsdp": 2}, 4, "stage"),
        ("grpo", {"data": 2, "stage": 2, "fsdp": 2}, 2, "layers"),
        ("sft", {"stage": 2, "sequence": 2, "fsdp": 2}, 2, "stage"),
    ],
    ids=[
        "sft-stage2-fsdp4",
        "sft-stage4-fsdp2-stage_remat",
        "dpo-stage4-fsdp2-stage_remat",
        "grpo-data2-stage2-fsdp2",
        "sft-stage2-sequence2-fsdp2-stage_remat",
    ],
)
def test_pipelined_losses_equal_one_device(devices, method, axes, microbatches, remat):
    """Stages with each remat choice, and stages whose rows are also split along their length
    (ring attention inside a stage), give one device's loss and gradients."""
    config = CONFIG.replace(pipeline_microbatches=microbatches, pipeline_remat=remat)
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
