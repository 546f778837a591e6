"""Pipeline parallelism on 8 fake CPU devices: the layer stack split over `stage` (with fsdp,
and data) gives one device's losses and gradients for SFT, DPO and the GRPO loss (GPipe
schedule, microbatches)."""

import jax
import numpy as np
import pytest

from posttrain.models import get_preset, init_params, param_shardings
from posttrain.models._pipeline import bubble_fraction
from posttrain.parallel import MeshConfig, make_mesh
from tests.losses.test_chunked import close_trees, loss_and_batch
from tests.tolerance import assert_close

# Four layers (a sliding window on the first) and rows that split into 4 microbatches of 2.
CONFIG = get_preset(
    "tiny", attention="xla", num_layers=4, sliding_window=24, sliding_window_layers=(0,)
)
ROWS, LENGTH = 8, 32


def _loss_and_grads(method, config, axes=None, devices=None):
    loss, batch = loss_and_batch(method, np.random.RandomState(3), config, ROWS, LENGTH)
    params = init_params(config, jax.random.key(2))

    def objective(params, batch):
        sums = loss(params, batch, None)
        return sums["loss_sum"], sums

    run = jax.jit(jax.value_and_grad(objective, has_aux=True))
    if axes is None:
        return jax.device_get(run(params, batch))
    mesh = make_mesh(MeshConfig.from_dict(axes), devices)
    with jax.set_mesh(mesh):
        params = jax.device_put(params, param_shardings(config, mesh))
        assert "collective_permute" in run.lower(params, batch).as_text()  # stages pass rows on
        return jax.device_get(run(params, batch))


@pytest.mark.parametrize(
    "method, axes, microbatches",
    [
        ("sft", {"stage": 2, "fsdp": 4}, 4),
        ("sft", {"stage": 4, "fsdp": 2}, 2),
        ("dpo", {"stage": 4, "fsdp": 2}, 4),
        ("grpo", {"data": 2, "stage": 2, "fsdp": 2}, 2),
    ],
    ids=["sft-stage2-fsdp4", "sft-stage4-fsdp2", "dpo-stage4-fsdp2", "grpo-data2-stage2-fsdp2"],
)
def test_pipelined_losses_equal_one_device(devices, method, axes, microbatches):
    config = CONFIG.replace(pipeline_microbatches=microbatches)
    (_, sums0), grads0 = _loss_and_grads(method, CONFIG)
    (_, sums), grads = _loss_and_grads(method, config, axes, devices)
    for name, value in sums0.items():
        assert_close(sums[name], value, rtol=1e-5, err_msg=name)
    close_trees(grads, grads0, rtol=1e-5)


def test_bubble_fraction():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 4) == 3 / 7
    assert bubble_fraction(2, 16) == 1 / 17
