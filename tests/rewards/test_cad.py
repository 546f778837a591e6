"""CAD scripts in the sandbox: the construction tree a script prints is built by the kernel, a
reference script's part scores 1 on its own target, and hostile scripts (endless loops, memory
hogs, a million-part union, a part doubled 16 times, absurd sizes, output floods, a part within
every cap that is too big to build) are stopped by a cap or limit that says which."""

import re
import resource
import shutil
import time

import manifold3d as m3d
import pytest

from posttrain.rewards import _cad_builder
from posttrain.rewards._cad import MAX_NODES, run_script
from posttrain.rewards._cad_geometry import CADTask, score

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")

PLATE = """
import cad
plate = cad.box(40, 20, 4)
for x in (10, 30):
    plate = plate - cad.cylinder(6, 3).translate(x, 10, -1)
cad.show(plate)
"""


def _target():
    solid = m3d.Manifold.cube([40.0, 20.0, 4.0])
    for x in (10.0, 30.0):
        solid = solid - m3d.Manifold.cylinder(6.0, 3.0, 3.0, 48).translate([x, 10.0, -1.0])
    return solid


def test_a_reference_script_builds_its_target_and_scores_one():
    result = run_script(PLATE)
    assert result.error == "" and result.solid is not None
    got = score(result.solid, _target(), CADTask(holes=2))
    assert got["total"] == pytest.approx(1.0) and got["iou"] == pytest.approx(1.0)
    assert run_script(PLATE).solid.volume() == result.solid.volume()  # deterministic


def test_a_loop_of_300_unions_builds():
    result = run_script(
        UNIONS.format(n=300).replace("translate(i, 0, 0)", "translate(2 * i, 0, 0)")
    )
    assert result.error == "" and len(result.solid.decompose()) == 300  # (the first overlaps)


def test_every_primitive_and_transform_builds():
    code = """
import cad
ring = cad.revolve([(8, 0), (10, 0), (10, 3), (8, 3)], 360, 64)
prism = cad.extrude([(0, 0), (6, 0), (3, 5)], 2).rotate(0, 0, 90).mirror(1, 0, 0)
ball = cad.sphere(2).scale(1, 1, 0.5).translate(0, 0, 10)
cone = cad.cone(4, 3, 1).translate(20, 0, 0)
cad.show(cad.union(ring, prism, ball, cone) & cad.box(100, 100, 100).translate(-50, -50, -1))
"""
    result = run_script(code)
    assert result.error == "", result.error
    assert len(result.solid.decompose()) == 4


UNIONS = (
    "import cad\ns = cad.box(1, 1, 1)\nfor i in range({n}):\n"
    "    s = s + cad.box(1, 1, 1).translate(i, 0, 0)\ncad.show(s)"
)
HOSTILE = {
    "endless": ("import cad\nwhile True: pass", "timed out"),
    "memory": ("import cad\nx = bytearray(10**10)", "the script failed: MemoryError"),
    # (what stops it first depends on the CPU: the time limit, or on a faster one the memory
    # cap while the million nodes are still being built)
    "million-part union": (UNIONS.format(n=10**6), "timed out|cut off|more than|MemoryError"),
    "node cap": (UNIONS.format(n=MAX_NODES), f"more than {MAX_NODES} operations"),
    "huge size": ("import cad\ncad.show(cad.box(1e9, 1, 1))", "exceeds the 10000 mm limit"),
    "facets": ("import cad\ncad.show(cad.cylinder(1, 1, segments=100000))", "in 3..256"),
    "output flood": ("import cad\nprint('x' * 10**7)\ncad.show(cad.box(1, 1, 1))", "0 ti|cut"),
    "no show": ("import cad\nprint('no part')", "called cad.show 0 times"),
    "nan": ("import cad\ncad.box(float('nan'), 1, 1)", "ValueError: x must be a finite"),
}  # fmt: skip


@pytest.mark.parametrize("code, message", list(HOSTILE.values()), ids=list(HOSTILE))
def test_hostile_scripts_are_stopped_with_a_reason(code, message):
    result = run_script(code, timeout_s=3.0)
    assert result.solid is None
    assert re.search(message, result.error), result.error


def _doubling(n: int) -> str:
    """A box united with a shifted copy of itself n times: 2^n boxes on a grid (no two touch)
    from a tree of 2n + 1 nodes, each union's two children one shared sub-part."""
    shift = "*[2 ** (i // 3 + 1) * (axis == i % 3) for axis in range(3)]"
    return (f"import cad\ns = cad.box(1, 1, 1)\nfor i in range({n}):\n"
            f"    s = s + s.translate({shift})\ncad.show(s)\n")  # fmt: skip


@pytest.mark.parametrize("n", [8, 12, 16])
def test_a_doubling_union_is_built_within_the_caps_or_refused_by_its_size(n):
    """Counted as if written out (each use of a shared sub-part counts), 8 doublings are 256
    boxes in 766 operations, a part within MAX_NODES that builds; 12 and 16 are refused before
    any geometry, by the operation cap, at once."""
    start = time.monotonic()
    result = run_script(_doubling(n))
    seconds = time.monotonic() - start
    ops = 2**n + 2 * (2**n - 1)  # the boxes, and a translate and a union per copy
    if n == 8:
        assert ops <= MAX_NODES and result.error == "", result.error
        assert result.measurements.bodies == 256 and result.solid.volume() == pytest.approx(256)
    else:
        assert result.solid is None and ops > MAX_NODES
        assert f"describes {ops:,} operations ({2**n:,} primitives)" in result.error
        assert f"the limit is {MAX_NODES}" in result.error
    assert seconds < 10.0  # run_script's timeout_s (the documented limit)


def test_the_operation_cap_counts_shared_sub_parts_without_building_them():
    from posttrain.rewards._cad_kernel import CADError, check

    nodes = [{"op": "box", "args": [1, 1, 1], "children": []}]
    for _ in range(600):  # 600 doublings: 1201 nodes, about 3 * 2^600 operations
        nodes.append({"op": "translate", "args": [1, 0, 0], "children": [len(nodes) - 1]})
        nodes.append({"op": "union", "args": [], "children": [len(nodes) - 2, len(nodes) - 1]})
    with pytest.raises(CADError, match=r"describes about 10\^181 operations \(about 10\^180 "
                       r"primitives\) .*; the limit is 2000"):  # fmt: skip
        check({"nodes": nodes, "root": len(nodes) - 1})
    assert check({"nodes": nodes[:17], "root": 16})[1] == 16  # 8 doublings: 766 operations


# 300 overlapping 256-facet spheres: 599 operations, within every cap a tree is checked
# against, but millions of triangles for the kernel to intersect.
SPHERES = ("import cad\ns = cad.sphere(5, 256)\nfor i in range(1, 300):\n"
           "    s = s + cad.sphere(5, 256).translate(i, 0, 0)\ncad.show(s)\n")  # fmt: skip
# 600 disjoint 256-facet cylinders: 611,000 triangles, a few seconds to build and measure.
CYLINDERS = ("import cad\ns = cad.box(1, 1, 1)\nfor i in range(1, 600):\n"
             "    s = s + cad.cylinder(1, 0.5, segments=256).translate(2 * (i % 30), "
             "2 * (i // 30), 0)\ncad.show(s)\n")  # fmt: skip


def test_a_part_within_the_caps_too_big_to_build_is_stopped_by_the_memory_limit():
    """The build runs in a child process with its own memory limit: it fails there (the
    kernel raises MemoryError or crashes), and this process never holds the geometry."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    start = time.monotonic()
    result = run_script(SPHERES, timeout_s=5.0, memory_mb=64)
    assert time.monotonic() - start < 5.0 + 1.0
    assert result.solid is None
    assert re.search(r"needed more than 64 MB|crashed the geometry kernel \(SIG\w+\), as "
                     r"running out of its 64 MB does|took longer than 5 s", result.error), (
        result.error)  # fmt: skip
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10


def test_a_part_that_builds_too_slowly_is_killed_at_the_deadline():
    assert run_script(PLATE).error == ""  # (the builder's helper process is up)
    helper = _cad_builder._HELPER["proc"].pid
    start = time.monotonic()
    result = run_script(CYLINDERS, timeout_s=1.0, memory_mb=1024)
    assert time.monotonic() - start < 1.0 + 0.5
    assert result.solid is None
    # (on a loaded machine the script itself may be what runs out of the second)
    assert result.error in ("the script and building its part took longer than 1 s",
                            "the script timed out after 1 s")  # fmt: skip
    children = f"/proc/{helper}/task/{helper}/children"
    for _ in range(100):  # the killed child is reaped by the helper at once
        with open(children) as f:
            if not f.read().split():
                break
        time.sleep(0.01)
    else:
        raise AssertionError(f"the build's process outlived its deadline: {children}")
    assert run_script(PLATE).error == "" and _cad_builder._HELPER["proc"].pid == helper


def _tree(code: str) -> dict:
    """The construction tree a script shows, computed on the host with the same API."""
    import contextlib
    import io
    import json
    import sys

    from posttrain.rewards import _cad_api

    out = io.StringIO()
    sys.modules["cad"] = _cad_api
    try:
        with contextlib.redirect_stdout(out):
            exec(code, {})
    finally:
        del sys.modules["cad"]
    return json.loads(out.getvalue().strip().removeprefix(_cad_api.MARKER))


def test_the_cad_domain_scores_a_completion_against_the_records_target():
    """Through the default registry's "cad" domain, as RL scores a completion."""
    from posttrain.rewards import default_registry

    registry = default_registry()
    record = {"prompt": "a plate with two holes", "domain": "cad", "target": _tree(PLATE),
              "holes": 2}  # fmt: skip
    total, info = registry.score(record, f"Here it is:\n```python\n{PLATE}```")
    assert total == pytest.approx(1.0) and info["cad_reward"]["error"] == ""
    one_hole = PLATE.replace("(10, 30)", "(10,)")
    total, info = registry.score(record, f"```python\n{one_hole}```")
    assert info["cad_reward"]["components"]["holes"] == 0 and 0 < total < 1
    total, info = registry.score(record, "```python\nimport cad\n1 / 0\n```")
    assert total == 0 and "ZeroDivisionError" in info["cad_reward"]["error"]
    total, info = registry.score(record, f"```python\n{_doubling(16)}```")  # refused: scores 0
    assert total == 0 and "65,536 primitives" in info["cad_reward"]["error"]
    assert info["cad_reward"]["components"] == dict.fromkeys(info["cad_reward"]["components"], 0)


CROSSING = """
import cad
block = cad.box(20, 20, 20)
bore = cad.cylinder(24, 3)
block = block - bore.rotate(0, 90, 0).translate(-2, 10, 10)  # along x
block = block - bore.rotate(-90, 0, 0).translate(10, -2, 10)  # along y, crossing it
cad.show(block)
"""


def test_two_crossing_bores_are_two_holes_through_the_sandbox():
    """The crossing-holes fixture end to end: a record asking for 2 holes, its reference script
    scores 1 (the genus would say 3)."""
    from posttrain.rewards._cad import cad_reward

    result = run_script(CROSSING)
    assert result.measurements.holes == 2 and result.measurements.bodies == 1
    total, info = cad_reward({"target": _tree(CROSSING), "holes": 2}, CROSSING)
    assert total == pytest.approx(1.0) and info["components"]["holes"] == 1
