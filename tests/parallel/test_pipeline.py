"""Pipeline parallelism on 8 fake CPU devices: the layer stack split over `stage` (with fsdp,
and data) gives one device's losses and gradients for SFT, DPO and the GRPO loss (GPipe
schedule, microbatches)."""

import pytest

from posttrain.models import get_preset
from posttrain.models._pipeline import bubble_fraction
from posttrain.parallel import MeshConfig, make_mesh
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
