"""CAD scripts: run a model's script in the code sandbox, build the solid it describes.

The script (written against `posttrain/rewards/_cad_api.py`, copied into the sandbox as
`cad.py`) runs with the standard library only and prints a construction tree; the host checks
the tree against hard caps before the geometry kernel (manifold3d) sees it, so a script can
exhaust neither the sandbox (time, memory, output limits) nor the kernel: a tree of more than
`MAX_NODES` operations (a million-part union), more than `MAX_SEGMENTS` facets per circle or
`MAX_POINTS` profile points, sizes beyond `MAX_SIZE` mm or non-finite numbers are refused with a
message that says which cap was hit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping

from posttrain.rewards import sandbox
from posttrain.rewards._cad_api import MARKER
from posttrain.rewards._cad_geometry import DEFAULT_WEIGHTS, CADTask, score
from posttrain.rewards._code import extract_code

MAX_NODES = 2000  # operations in one part's construction tree
MAX_SEGMENTS = 256  # facets of a circle (cylinder, sphere, revolve)
MAX_POINTS = 1000  # vertices of an extruded or revolved profile
MAX_SIZE = 10_000.0  # mm: largest absolute size, offset or scale factor
API_SOURCE = open(os.path.join(os.path.dirname(__file__), "_cad_api.py")).read()


class CADError(ValueError):
    """The script's result cannot be built (the message says why)."""


@dataclasses.dataclass(frozen=True)
class ScriptResult:
    """What a CAD script produced: the solid (None on failure) and why it failed."""

    solid: object | None  # manifold3d.Manifold
    error: str  # "" when the solid was built
    stdout: str  # what the script printed besides the result (kept for feedback)


def _numbers(values, where: str) -> list[float]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise CADError(f"{where}: {v!r} is not a finite number")
        if abs(v) > MAX_SIZE:
            raise CADError(f"{where}: {v} exceeds the {MAX_SIZE:g} mm limit")
        out.append(float(v))
    return out


def _segments(n, where: str) -> int:
    if not isinstance(n, int) or not 3 <= n <= MAX_SEGMENTS:
        raise CADError(f"{where}: segments must be an integer in 3..{MAX_SEGMENTS}, got {n!r}")
    return n


def _profile(points, where: str) -> list[list[float]]:
    if not isinstance(points, list) or not 3 <= len(points) <= MAX_POINTS:
        raise CADError(f"{where}: a profile needs 3..{MAX_POINTS} points")
    return [_numbers(p, where) for p in points if isinstance(p, list) and len(p) == 2]


def build(tree: dict):
    """The `manifold3d.Manifold` a construction tree (`cad.Solid.to_json`) describes.

    Raises:
      CADError: the tree breaks a cap, is malformed or names an unknown operation.
    """
    nodes, root = (tree.get("nodes"), tree.get("root")) if isinstance(tree, dict) else (0, 0)
    if not isinstance(nodes, list) or not isinstance(root, int) or not 0 <= root < len(nodes):
        raise CADError("the part's description is malformed")
    if len(nodes) > MAX_NODES:
        raise CADError(f"the part has more than {MAX_NODES} operations")
    built: list = []
    for i, t in enumerate(nodes):
        kids = t.get("children", []) if isinstance(t, dict) else None
        if not isinstance(kids, list) or not all(isinstance(k, int) and 0 <= k < i for k in kids):
            raise CADError("the part's description is malformed")
        built.append(_node(t.get("op"), t.get("args", []), [built[k] for k in kids]))
    return built[root]


def _node(op, args, kids: list):
    """One operation of the tree, its children already built."""
    import manifold3d as m3d

    where = f"cad.{op}"
    if not isinstance(args, list):
        raise CADError(f"{where}: malformed arguments")
    if op == "box" and not kids:
        return m3d.Manifold.cube(_numbers(args[:3], where))
    if op == "cone" and not kids and len(args) == 4:
        h, r0, r1 = _numbers(args[:3], where)
        return m3d.Manifold.cylinder(h, r0, r1, _segments(args[3], where))
    if op == "sphere" and not kids and len(args) == 2:
        return m3d.Manifold.sphere(_numbers(args[:1], where)[0], _segments(args[1], where))
    if op == "extrude" and not kids and len(args) == 2:
        section = m3d.CrossSection([_profile(args[0], where)])
        return m3d.Manifold.extrude(section, _numbers(args[1:2], where)[0])
    if op == "revolve" and not kids and len(args) == 3:
        section = m3d.CrossSection([_profile(args[0], where)])
        degrees = _numbers(args[1:2], where)[0]
        return m3d.Manifold.revolve(section, _segments(args[2], where), degrees)
    if op in ("translate", "rotate", "scale", "mirror") and len(kids) == 1 and len(args) == 3:
        return getattr(kids[0], op)(_numbers(args, where))
    if op in ("union", "difference", "intersection") and len(kids) == 2:
        a, b = kids
        return {"union": a + b, "difference": a - b, "intersection": a ^ b}[op]
    raise CADError(f"unknown or malformed operation {op!r}")


def run_script(code: str, *, timeout_s: float = 10.0, memory_mb: int = 256) -> ScriptResult:
    """Runs a CAD script in the sandbox and builds its part."""
    result = sandbox.run(
        code, timeout_s=timeout_s, memory_mb=memory_mb, files={"cad.py": API_SOURCE}
    )
    lines = result.stdout.splitlines()
    shown = [line for line in lines if line.startswith(MARKER)]
    printed = "\n".join(line for line in lines if not line.startswith(MARKER))
    if result.timed_out:
        return ScriptResult(None, f"the script timed out after {timeout_s:g} s", printed)
    if result.exit_code != 0:
        tail = result.stderr.strip().splitlines()[-1:] or [f"exit code {result.exit_code}"]
        return ScriptResult(None, f"the script failed: {tail[0]}", printed)
    if len(shown) != 1:
        return ScriptResult(None, f"the script called cad.show {len(shown)} times (once)", printed)
    try:
        solid = build(json.loads(shown[0][len(MARKER) :]))
    except json.JSONDecodeError:
        return ScriptResult(None, "the part's description is cut off (too large)", printed)
    except CADError as e:
        return ScriptResult(None, str(e), printed)
    return ScriptResult(solid, "", printed)


def completion_part(completion: str, **limits) -> ScriptResult:
    """Runs a completion's script (its last ```python block, else the whole text) and builds
    its part (`run_script`; `limits`: timeout_s, memory_mb)."""
    return run_script(extract_code(completion) or completion, **limits)


def cad_reward(
    record: Mapping, completion: str, *, timeout_s: float = 10.0, memory_mb: int = 256
) -> tuple[float, dict]:
    """The `cad` domain: the completion's script (its last ```python block, else the whole
    text) is run and its part scored against the record's target (`_cad_geometry.score`).

    Args:
      record: `target`, the target part's construction tree (what `cad.show` prints, parsed);
        optional `holes` (through-holes the part must have), `tolerance` (relative, on the
        bounding box's extents) and `weights` ({component: weight}).
      completion: the generated text.

    Returns:
      (total, info): info["components"] holds every component (`valid`, `iou`,
      `dimensions`, `holes`, `single_body`, `stable`; RL logs each one's mean) and
      info["error"] why the script produced no part ("" if it did).
    """
    target = build(record["target"])
    weights = record.get("weights") or DEFAULT_WEIGHTS
    task = CADTask(
        holes=record.get("holes"),
        tolerance=float(record.get("tolerance", CADTask.tolerance)),
        weights=tuple(dict(weights).items()),
    )
    result = completion_part(completion, timeout_s=timeout_s, memory_mb=memory_mb)
    parts = score(result.solid, target, task) if result.solid is not None else None
    if parts is None:
        parts = {**dict.fromkeys(dict(task.weights), 0.0), "total": 0.0}
    total = parts.pop("total")
    return total, {"components": parts, "error": result.error}
