"""Mesh construction and the logical-axis rules."""

import pytest
from jax.sharding import PartitionSpec as P

from posttrain.parallel import MESH_AXES, MeshConfig, axis_rules, logical_to_spec, make_mesh


def test_mesh_axes_and_fill(devices):
    mesh = make_mesh(MeshConfig.from_dict({"data": 2, "tensor": -1}))
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == {
        "data": 2, "stage": 1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 4
    }  # fmt: skip
    assert dict(make_mesh().shape)["fsdp"] == 8  # default: all devices on fsdp


def test_mesh_configs_saved_before_the_stage_axis_still_load():
    """Checkpoints store the mesh as one size per axis; those written with five axes (no
    `stage`) resume."""
    saved = MeshConfig.from_config({"ici": [1, -1, 1, 1, 2], "dcn": [2, 1, 1, 1, 1]})
    assert saved.ici == (1, 1, -1, 1, 1, 2) and saved.dcn == (2, 1, 1, 1, 1, 1)


@pytest.mark.parametrize(
    "ici, message",
    [
        ({"data": 3, "fsdp": -1}, r"data=3.*3 does not divide 8 devices per slice"),
        ({"data": 2, "tensor": 2}, r"multiplies to 4, but there are 8 devices per slice"),
        ({"data": -1, "fsdp": -1}, "-1 for one axis only"),
        ({"model": 8}, r"unknown axes \['model'\]"),
    ],
)
def test_bad_mesh_is_a_clear_error(devices, ici, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(MeshConfig.from_dict(ici))


def test_dcn_without_slices_is_an_error(devices):
    with pytest.raises(
        ValueError, match=r"mesh.dcn \(data=2\) multiplies to 2, but there are 1 slice"
    ):
        make_mesh(MeshConfig.from_dict({"fsdp": -1}, {"data": 2}))


def test_logical_to_spec_rules(devices):
    mesh = make_mesh(MeshConfig.from_dict({"data": 2, "fsdp": 2, "tensor": 2}))
    # Params: embed over fsdp, heads over tensor; layers and head_dim replicated.
    assert logical_to_spec(("layers", "embed", "heads", "head_dim"), (4, 64, 8, 16), mesh) == P(
        None, "fsdp", "tensor"
    )
    # Activations: the batch takes every data-like axis present.
    assert logical_to_spec(("act_batch", "act_length", "act_embed"), (8, 16, 64), mesh) == P(
        ("data", "fsdp")
    )
    # A dimension the mesh axes do not divide keeps the dividing prefix (here: only data).
    assert logical_to_spec(("act_batch",), (2,), mesh) == P("data")
    # A mesh axis is used once: heads took tensor, so kv_heads stays replicated.
    assert logical_to_spec(("heads", "kv_heads"), (8, 4), mesh) == P("tensor")
    with pytest.raises(KeyError, match="'nonsense' has no sharding rule"):
        logical_to_spec(("nonsense",), (8,), mesh)


def test_rules_are_data(devices):
    mesh = make_mesh(MeshConfig.from_dict({"fsdp": 2, "tensor": 4}))
    with axis_rules((("embed", "tensor"), ("mlp", "fsdp"))):
        assert logical_to_spec(("embed", "mlp"), (64, 128), mesh) == P("tensor", "fsdp")
    assert logical_to_spec(("embed", "mlp"), (64, 128), mesh) == P("fsdp", "tensor")
