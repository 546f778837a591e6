"""A construction tree (what `cad.show` prints) checked against hard caps and built with the
geometry kernel (manifold3d).

`check(tree)` is cheap (no geometry) and refuses a tree that breaks a cap, with a message that
says which: more than `MAX_NODES` operations, counted as if the script had written every part
out (a sub-part used twice counts twice, so a part united with a shifted copy of itself 16
times is 196,606 operations, not the 33 nodes it prints), more than `MAX_SEGMENTS` facets per
circle or `MAX_POINTS` profile points, sizes beyond `MAX_SIZE` mm or non-finite numbers (the
last three as `build` meets them). `build(tree)` checks, then builds: call it on trusted trees
only (a task's target); a script's tree is built by `_cad_builder` under hard time and memory
limits.
"""

from __future__ import annotations

import math

MAX_NODES = 2000  # operations in one part, each use of a shared sub-part counted
MAX_SEGMENTS = 256  # facets of a circle (cylinder, sphere, revolve)
MAX_POINTS = 1000  # vertices of an extruded or revolved profile
MAX_SIZE = 10_000.0  # mm: largest absolute size, offset or scale factor
PRIMITIVES = ("box", "cone", "sphere", "extrude", "revolve")


class CADError(ValueError):
    """The script's result cannot be built (the message says why)."""


def check(tree) -> tuple[list, int]:
    """The tree's (nodes, root) once its shape and size are within the caps.

    Raises:
      CADError: malformed, or more than `MAX_NODES` operations once shared sub-parts are
        counted at each use.
    """
    nodes, root = (tree.get("nodes"), tree.get("root")) if isinstance(tree, dict) else (0, 0)
    if not isinstance(nodes, list) or not isinstance(root, int) or not 0 <= root < len(nodes):
        raise CADError("the part's description is malformed")
    if len(nodes) > MAX_NODES:
        raise CADError(f"the part has more than {MAX_NODES} operations")
    # (operations, primitives) each node stands for once written out; exact integers (a tree
    # of 2000 nodes can double 1000 times), compared with the cap once, at the root.
    sizes: list[tuple[int, int]] = []
    for i, t in enumerate(nodes):
        kids = t.get("children", []) if isinstance(t, dict) else None
        if not isinstance(kids, list) or not all(isinstance(k, int) and 0 <= k < i for k in kids):
            raise CADError("the part's description is malformed")
        ops = 1 + sum(sizes[k][0] for k in kids)
        leaves = sum(sizes[k][1] for k in kids) if kids else int(t.get("op") in PRIMITIVES)
        sizes.append((ops, leaves))
    ops, leaves = sizes[root]
    if ops > MAX_NODES:
        raise CADError(
            f"the part describes {_count(ops)} operations ({_count(leaves)} primitives) once each "
            f"reused sub-part is counted where it is used; the limit is {MAX_NODES}"
        )
    return nodes, root


def _count(n: int) -> str:
    return f"{n:,}" if n < 10**15 else f"about 10^{len(str(n)) - 1}"


def build(tree):
    """The `manifold3d.Manifold` a construction tree (`cad.Solid.to_json`) describes.

    Raises:
      CADError: the tree breaks a cap, is malformed or names an unknown operation.
    """
    nodes, root = check(tree)
    built: list = []
    for t in nodes:
        built.append(_node(t.get("op"), t.get("args", []), [built[k] for k in t["children"]]))
    return built[root]


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
