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
    # A permute's pairs, each a group of two (once read as no groups: every device, which made
    # a ring inside one slice of a 2-slice plan count as DCN traffic).
    pairs = _groups("source_target_pairs={{0,3},{1,0},{2,1},{3,2}}, backend_config={}", 8)
    np.testing.assert_array_equal(pairs, [[0, 3], [1, 0], [2, 1], [3, 2]])


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


# An async collective fusion as libtpu (jax[tpu] 0.10.2) prints it with MaxText's
# `--xla_tpu_enable_async_collective_fusion*` flags: the all-gather appears in the start's
# computation, the done's and a fusion with compute, under one channel id. Trimmed by hand.
_ASYNC_FUSION_HLO = """HloModule m, entry_computation_layout={()->f32[]}

%start (p: bf16[128,256]) -> (bf16[128,256], bf16[1024,256]) {
  %p = bf16[128,256]{1,0} parameter(0)
  %all-gather.1 = bf16[1024,256]{1,0} all-gather(%p), channel_id=7, replica_groups=[1,8]<=[8], dimensions={0}, backend_config={"async_collective_fusion_config":{"flag_start":"-1"}}
  ROOT %t = (bf16[128,256]{1,0}, bf16[1024,256]{1,0}) tuple(%p, %all-gather.1)
}

%done (q: bf16[128,256]) -> bf16[1024,256] {
  %q = bf16[128,256]{1,0} parameter(0)
  ROOT %all-gather.2 = bf16[1024,256]{1,0} all-gather(%q), channel_id=7, replica_groups=[1,8]<=[8], dimensions={0}, backend_config={"async_collective_fusion_config":{"flag_start":"2"}}
}

%body (s: (s32[], bf16[128,256])) -> (s32[], bf16[128,256]) {
  %s = (s32[], bf16[128,256]{1,0}) parameter(0)
  %w = bf16[128,256]{1,0} get-tuple-element(%s), index=1
  %async-collective-start.1 = (bf16[128,256]{1,0}, bf16[1024,256]{1,0}) fusion(%w), kind=kCustom, calls=%start
  %async-collective-done.1 = bf16[1024,256]{1,0} fusion(%w), kind=kCustom, calls=%done
  %i = s32[] get-tuple-element(%s), index=0
  ROOT %r = (s32[], bf16[128,256]{1,0}) tuple(%i, %w)
}

%cond (c: (s32[], bf16[128,256])) -> pred[] {
  %c = (s32[], bf16[128,256]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main () -> f32[] {
  %init = (s32[], bf16[128,256]{1,0}) parameter(0)
  %loop = (s32[], bf16[128,256]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %z = f32[] constant(0)
}
"""  # noqa: E501 (HLO lines as libtpu prints them)


def test_an_async_collective_fusion_is_one_overlappable_collective():
    (gather,) = collectives(_ASYNC_FUSION_HLO, devices=8, torus=(2, 2, 2))
    assert (gather.kind, gather.count, gather.group, gather.nbytes) == (
        "all-gather",
        5,
        8,
        1024 * 256 * 2,
    )
    assert gather.overlappable  # it may run under compute: the roofline hides it there


def test_every_permute_of_a_ring_counts_though_xla_gives_them_one_channel():
    """Ring attention's hops: each scan step passes a [128, 256] bf16 shard and its int32
    positions to the next device. XLA numbers every collective-permute channel 1; the count
    once merged them all into one (the 128k plan's ring read 0.000 GiB)."""
    _, devices = topology_devices("v5p-16")  # 8 chips
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    ring = [(i, (i + 1) % 8) for i in range(8)]

    def hops(k, pos):
        def hop(carry, _):
            k, pos, total = carry
            k, pos = jax.lax.ppermute((k, pos), "x", ring)
            return (k, pos, total + jnp.sum(jnp.tanh(k)) + jnp.sum(pos)), None

        init = (k, pos, jnp.zeros((), jnp.float32))
        return jax.lax.scan(hop, init, length=5)[0][2][None]

    f = jax.shard_map(hops, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"), check_vma=False)
    k = jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    pos = jax.ShapeDtypeStruct((1024,), jnp.int32, sharding=NamedSharding(mesh, P("x")))
    hlo = jax.jit(f).lower(k, pos).compile().as_text()
    permutes = [c for c in collectives(hlo, devices=8, torus=(2, 2, 2))
                if c.kind == "collective-permute"]  # fmt: skip
    moved = sum(c.count * c.nbytes for c in permutes)
    assert moved == 5 * (128 * 256 * 2 + 128 * 4), permutes
    assert all(c.group == 2 and c.dims == 1 for c in permutes), permutes  # a hop: one link
