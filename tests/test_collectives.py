"""`posttrain compile`'s communication count: collectives read from TPU programs compiled on a
CPU host (libtpu), checked against hand-computed counts, bytes and ring times."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from posttrain._collectives import _groups, collectives, summary
from posttrain.aot import CHIPS, topology_devices

pytest.importorskip("libtpu")


def test_replica_groups_in_each_spelling_xla_prints():
    explicit = _groups("replica_groups={{0,2,4,6},{1,3,5,7}}, to_apply=%add", 8)
    iota = _groups("replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}", 8)
    np.testing.assert_array_equal(explicit, [[0, 2, 4, 6], [1, 3, 5, 7]])
    np.testing.assert_array_equal(iota, explicit)  # iota(8) as [4, 2], transposed, 2 groups
    mesh = _groups("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, use_global", 8)
    np.testing.assert_array_equal(mesh, explicit)  # axis_0 varies within a group
    np.testing.assert_array_equal(_groups("channel_id=3, to_apply=%add", 4), [[0, 1, 2, 3]])


def _compile(devices, mesh_shape, names, spec):
    """A 5-step scan whose body gathers one [1024, 256] bf16 slice of a sharded stack."""
    mesh = jax.sharding.Mesh(np.array(devices).reshape(mesh_shape), names)

    def f(ws, x):
        def body(total, w):
            w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))  # all-gather
            return total + jnp.sum(jnp.tanh(x @ w)), None

        return jax.lax.scan(body, jnp.zeros((), jnp.float32), ws)[0]

    ws = jax.ShapeDtypeStruct((5, 1024, 256), jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    x = jax.ShapeDtypeStruct((16, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    return jax.jit(f).lower(ws, x).compile().as_text()


def test_a_scanned_all_gather_counts_every_iteration_at_the_ring_time():
    _, devices = topology_devices("v5p-16")  # 8 chips, a 2x2x2 torus
    hlo = _compile(devices, (8,), ("x",), P(None, "x", None))
    gathers = [c for c in collectives(hlo, devices=8, torus=(2, 2, 2)) if c.kind == "all-gather"]
    assert len(gathers) == 1, gathers
    (gather,) = gathers
    assert (gather.count, gather.group, gather.nbytes, gather.dims) == (5, 8, 1024 * 256 * 2, 3)
    assert not gather.dcn
    chip = CHIPS["v5p"]  # 1,200 GB/s over 6 ports: 200 GB/s a port; 3 rings of 2 ports
    moved = 5 * 1024 * 256 * 2 * 7 / 8
    table = summary([gather], chip.ici_port, chip.dcn_bandwidth)
    assert table["all-gather"]["bytes"] == moved
    assert table["total"]["seconds"] == pytest.approx(moved / (3 * 200e9), rel=1e-12)


def test_a_group_that_spans_two_slices_goes_over_dcn():
    _, devices = topology_devices("v5e-8", num_slices=2)  # 2 slices of 8 chips
    assert {d.slice_index for d in devices} == {0, 1}
    devices = sorted(devices, key=lambda d: (d.slice_index, d.id))
    hlo = _compile(devices, (2, 8), ("dcn", "x"), P(None, ("dcn", "x"), None))
    slice_of = lambda i: devices[i].slice_index  # noqa: E731
    found = collectives(hlo, devices=16, slice_of=slice_of, torus=(2, 4))
    # Each slice gathers its 512 rows over ICI, and trades its half with the other slice
    # through the megascale runtime: [2, 64, 256] bf16 received, half of it from the other.
    over_dcn = [c for c in found if c.dcn]
    assert [(c.kind, c.count, c.group, c.nbytes) for c in over_dcn] == [
        ("all-gather", 5, 2, 2 * 64 * 256 * 2)
    ], found
    assert over_dcn[0].moved == 64 * 256 * 2
    chip = CHIPS["v5e"]
    table = summary(found, chip.ici_port, chip.dcn_bandwidth)
    assert table["total"]["dcn_seconds"] == pytest.approx(
        sum(c.count * c.moved for c in over_dcn) / 3.125e9, rel=1e-12
    )
