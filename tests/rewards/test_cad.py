"""CAD scripts in the sandbox: the construction tree a script prints is built by the kernel, a
reference script's part scores 1 on its own target, and hostile scripts (endless loops, memory
hogs, a million-part union, absurd sizes, output floods) are stopped by a cap that says which."""

import re
import shutil

import manifold3d as m3d
import pytest

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
