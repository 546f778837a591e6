"""The CAD API a model's script is written against (`import cad`), standard library only.

A script builds solids from primitives, transforms and booleans and ends with `cad.show(part)`:

    import cad
    plate = cad.box(40, 20, 4)
    for x in (10, 30):
        plate = plate - cad.cylinder(6, 3).translate(x, 10, -1)
    cad.show(plate)

Nothing here computes geometry: each call records a node of a construction tree, and `show`
prints the tree as one JSON line (a flat list of nodes, children first). The script runs in the
code sandbox (standard library only); the host checks the tree against caps (operations,
counting each use of a shared sub-part; facets; finite sizes) and has the geometry kernel build
it in a child process under the script's own limits (`posttrain.rewards._cad`), so untrusted
code never touches the kernel. This file is copied into the sandbox as `cad.py`.

Units are millimetres; angles degrees. Primitives sit on the XY plane at the origin:
`box(x, y, z)` spans [0, x] x [0, y] x [0, z]; `cylinder(height, radius)` and
`cone(height, r_bottom, r_top)` stand on the origin along +z; `sphere(radius)` is centred on it;
`extrude(points, height)` lifts a polygon `[(x, y), ...]` along +z; `revolve(points, degrees)`
turns a profile `[(r, z), ...]` (r >= 0) about the z axis.
"""

import json
import math

MARKER = "CAD_RESULT:"  # the line `show` prints starts with this


class Solid:
    """A node of the construction tree."""

    def __init__(self, op, args=(), children=()):
        self.op, self.args, self.children = op, list(args), list(children)

    def translate(self, x=0.0, y=0.0, z=0.0):
        return Solid("translate", [x, y, z], [self])

    def rotate(self, x=0.0, y=0.0, z=0.0):
        """Rotation about the x, then y, then z axis through the origin, in degrees."""
        return Solid("rotate", [x, y, z], [self])

    def scale(self, x=1.0, y=None, z=None):
        return Solid("scale", [x, x if y is None else y, x if z is None else z], [self])

    def mirror(self, x=0.0, y=0.0, z=0.0):
        """Reflection through the plane through the origin with normal (x, y, z)."""
        return Solid("mirror", [x, y, z], [self])

    def __add__(self, other):  # union
        return Solid("union", (), [self, _solid(other)])

    def __sub__(self, other):  # difference
        return Solid("difference", (), [self, _solid(other)])

    def __and__(self, other):  # intersection
        return Solid("intersection", (), [self, _solid(other)])

    def to_json(self):
        """The tree as a flat list of nodes, children before parents (a node used twice is
        listed once): `{"nodes": [{"op", "args", "children": [indices]}], "root": index}`."""
        index, nodes, stack = {}, [], [(self, False)]
        while stack:  # (iterative: a loop of thousands of unions nests that deep)
            solid, expanded = stack.pop()
            if id(solid) in index:
                continue
            if not expanded:
                stack.append((solid, True))
                stack.extend((c, False) for c in reversed(solid.children) if id(c) not in index)
                continue
            children = [index[id(c)] for c in solid.children]
            index[id(solid)] = len(nodes)
            nodes.append({"op": solid.op, "args": solid.args, "children": children})
        return {"nodes": nodes, "root": index[id(self)]}


def _solid(x):
    if not isinstance(x, Solid):
        raise TypeError(f"expected a cad solid, got {type(x).__name__}")
    return x


def _number(x, name):
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        raise ValueError(f"{name} must be a finite number, got {x!r}")
    return float(x)


def _positive(x, name):
    x = _number(x, name)
    if x <= 0:
        raise ValueError(f"{name} must be positive, got {x}")
    return x


def box(x, y, z):
    return Solid("box", [_positive(x, "x"), _positive(y, "y"), _positive(z, "z")])


def cylinder(height, radius, segments=48):
    return cone(height, radius, radius, segments)


def cone(height, r_bottom, r_top=0.0, segments=48):
    return Solid("cone", [_positive(height, "height"), _number(r_bottom, "r_bottom"),
                          _number(r_top, "r_top"), int(segments)])  # fmt: skip


def sphere(radius, segments=48):
    return Solid("sphere", [_positive(radius, "radius"), int(segments)])


def extrude(points, height):
    pts = [[_number(x, "x"), _number(y, "y")] for x, y in points]
    return Solid("extrude", [pts, _positive(height, "height")])


def revolve(points, degrees=360.0, segments=48):
    pts = [[_number(r, "r"), _number(z, "z")] for r, z in points]
    return Solid("revolve", [pts, _number(degrees, "degrees"), int(segments)])


def union(*solids):
    out = _solid(solids[0])
    for s in solids[1:]:
        out = out + s
    return out


def show(solid):
    """Prints the finished part (call it once, at the end of the script)."""
    print(MARKER + json.dumps(_solid(solid).to_json(), separators=(",", ":")))
