"""A generator of CAD tasks: a text description, the reference script that solves it, and the
target part's construction tree, for the `cad` reward domain (RL prompts) and for SFT.

Families by difficulty:

- level 1, `plate`: a rectangular plate with 1-3 through-holes in a row.
- level 2, `bracket`: an L-bracket (base and upright plates) with a hole in each leg;
  `flange`: a revolved disk with a centre bore and 3-6 bolt holes on a circle.
- level 3, `gear`: an extruded spur gear outline (trapezoid teeth) with a bore;
  `enclosure`: an open-top box with walls of a given thickness and a cable hole.

Every number is a whole or half millimetre drawn from the task's seed, so a task is
reproducible from `(seed, level)`. The reference scripts are parametric, as a designer's model
is: they give the numbers the text states names, in the text's order, and compute every other
one (a hole's radius, an inner wall, the bolt circle's radius, a tooth's angle), so a model
that learns from them copies numbers and never does the sums. The reference script is run on
the host (trusted code) to make the target tree; models' scripts run in the sandbox.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
import sys

from posttrain.rewards import _cad_api

INSTRUCTIONS = (
    "Write a Python script with the `cad` module (import cad) that builds the part, in "
    "millimetres, and ends with cad.show(part)."
)


def script_tree(code: str) -> dict:
    """The construction tree a trusted script (a task's reference) shows, run on the host."""
    out = io.StringIO()
    saved = sys.modules.get("cad")
    sys.modules["cad"] = _cad_api
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "<reference>", "exec"), {"__name__": "__cad__"})
    finally:
        if saved is None:
            del sys.modules["cad"]
        else:
            sys.modules["cad"] = saved
    shown = [line for line in out.getvalue().splitlines() if line.startswith(_cad_api.MARKER)]
    return json.loads(shown[-1][len(_cad_api.MARKER) :])


def _plate(rng: random.Random) -> tuple[str, str, int]:
    length, width, thick = rng.randrange(30, 81, 5), rng.randrange(15, 41, 5), rng.randrange(2, 7)
    n, d = rng.randint(1, 3), rng.choice((3, 4, 5, 6))
    xs = [round(length * (i + 1) / (n + 1), 1) for i in range(n)]
    text = (f"A {length} x {width} x {thick} mm rectangular plate with {n} through-hole(s) of "
            f"{d} mm diameter on its centre line, at x = "
            f"{', '.join(map(str, xs))} mm.")  # fmt: skip
    code = (f"import cad\nlength, width, thickness = {length}, {width}, {thick}\n"
            f"diameter = {d}\npart = cad.box(length, width, thickness)\n"
            f"for x in {tuple(xs)!r}:\n"
            "    hole = cad.cylinder(thickness + 2, diameter / 2).translate(x, width / 2, -1)\n"
            "    part = part - hole\ncad.show(part)\n")  # fmt: skip
    probes = [_hole(f"hole at x = {x}", thick, d, (x, width / 2, 0)) for x in xs]
    return text, code, n, probes


def _bracket(rng: random.Random) -> tuple[str, str, int]:
    length, width, height = (
        rng.randrange(30, 61, 5),
        rng.randrange(20, 41, 5),
        rng.randrange(20, 51, 5),
    )
    thick, d = rng.randrange(3, 7), rng.choice((4, 5, 6))
    text = (f"An L-bracket: a {length} x {width} x {thick} mm base plate and a {thick} mm thick "
            f"upright {height} mm tall along its back edge (y = 0), one {d} mm hole through the "
            f"middle of the base and one through the middle of the upright.")  # fmt: skip
    code = (f"import cad\nlength, width, thickness = {length}, {width}, {thick}\n"
            f"height = {height}\ndiameter = {d}\n"
            "base = cad.box(length, width, thickness)\n"
            "upright = cad.box(length, thickness, height)\npart = base + upright\n"
            "hole = cad.cylinder(thickness + 2, diameter / 2)\n"
            "part = part - hole.translate(length / 2, (width + thickness) / 2, -1)\n"
            "hole = cad.cylinder(thickness + 2, diameter / 2).rotate(-90, 0, 0)\n"
            "part = part - hole.translate(length / 2, -1, (height + thickness) / 2)\n"
            "cad.show(part)\n")  # fmt: skip
    probes = [
        _hole("hole through the base", thick, d, (length / 2, (width + thick) / 2, 0)),
        _hole("hole through the upright", thick, d, (length / 2, 0, (height + thick) / 2), "y"),
    ]
    return text, code, 2, probes


def _flange(rng: random.Random) -> tuple[str, str, int]:
    outer, bore, thick = rng.randrange(30, 61, 5), rng.randrange(8, 16, 2), rng.randrange(4, 9)
    n, d = rng.randint(3, 6), rng.choice((3, 4, 5))
    circle = (outer + bore) / 4
    text = (f"A flange: a disk of {outer} mm diameter and {thick} mm thickness with a {bore} mm "
            f"centre bore and {n} bolt holes of {d} mm on a {2 * circle:g} mm bolt "
            "circle.")  # fmt: skip
    code = (f"import cad\nimport math\ndiameter, thickness, bore = {outer}, {thick}, {bore}\n"
            f"bolts, bolt, circle = {n}, {d}, {2 * circle:g}\n"
            "r, R = bore / 2, diameter / 2\n"
            "part = cad.revolve([(r, 0), (R, 0), (R, thickness), (r, thickness)], 360, 96)\n"
            "for i in range(bolts):\n    a = 2 * math.pi * i / bolts\n"
            "    x, y = circle / 2 * math.cos(a), circle / 2 * math.sin(a)\n"
            "    hole = cad.cylinder(thickness + 2, bolt / 2).translate(x, y, -1)\n"
            "    part = part - hole\ncad.show(part)\n")  # fmt: skip
    probes = [_hole("centre bore", thick, bore, (0, 0, 0))]
    for i in range(n):
        a = 2 * math.pi * i / n
        at = (circle * math.cos(a), circle * math.sin(a), 0)
        probes.append(_hole(f"bolt hole {i + 1}", thick, d, at))
    return text, code, n + 1, probes


def _gear(rng: random.Random) -> tuple[str, str, int]:
    teeth, radius, depth = rng.randint(8, 16), rng.randrange(12, 25), rng.choice((2, 3))
    thick, bore = rng.randrange(4, 9), rng.choice((4, 5, 6))
    text = (f"A spur gear blank: {teeth} trapezoid teeth {depth} mm deep around a {2 * radius} mm "
            f"root circle, {thick} mm thick, with a {bore} mm centre bore.")  # fmt: skip
    code = (f"import cad\nimport math\nteeth, depth, root = {teeth}, {depth}, {2 * radius}\n"
            f"thickness, bore = {thick}, {bore}\n"
            "r, tip, w = root / 2, root / 2 + depth, math.pi / teeth\npoints = []\n"
            "for i in range(teeth):\n    a = 2 * math.pi * i / teeth\n"
            "    for da, radius in ((-w / 2, r), (-w / 4, tip), (w / 4, tip), (w / 2, r)):\n"
            "        points.append((radius * math.cos(a + da), radius * math.sin(a + da)))\n"
            "hole = cad.cylinder(thickness + 2, bore / 2).translate(0, 0, -1)\n"
            "part = cad.extrude(points, thickness) - hole\ncad.show(part)\n")  # fmt: skip
    # Each tooth filled and each gap between teeth empty, half-way up the teeth: the tooth count
    # and their places, whatever the outline between.
    w, mid = math.pi / teeth, radius + depth / 2
    r = min(depth / 4, 0.3 * mid * w)
    probes = [_hole("centre bore", thick, bore, (0, 0, 0))]
    for i in range(teeth):
        for name, a, kind in ((f"tooth {i + 1}", 2 * w * i, "filled"),
                              (f"gap after tooth {i + 1}", 2 * w * i + w, "empty")):  # fmt: skip
            probe = _cad_api.cylinder(0.8 * thick, r).translate(
                mid * math.cos(a), mid * math.sin(a), 0.1 * thick
            )
            probes.append((name, kind, probe))
    return text, code, 1, probes


def _enclosure(rng: random.Random) -> tuple[str, str, int]:
    length, width, height = (
        rng.randrange(40, 81, 5),
        rng.randrange(30, 61, 5),
        rng.randrange(20, 41, 5),
    )
    wall, d = rng.choice((2, 3)), rng.choice((6, 8))
    text = (f"An open-top enclosure, {length} x {width} x {height} mm outside, walls and floor "
            f"{wall} mm thick, with a {d} mm cable hole through the middle of the front wall "
            f"(y = 0), centred {height / 2:g} mm up.")  # fmt: skip
    code = (f"import cad\nlength, width, height = {length}, {width}, {height}\n"
            f"wall, diameter = {wall}, {d}\nouter = cad.box(length, width, height)\n"
            "inner = cad.box(length - 2 * wall, width - 2 * wall, height)"
            ".translate(wall, wall, wall)\npart = outer - inner\n"
            "hole = cad.cylinder(wall + 2, diameter / 2).rotate(-90, 0, 0)\n"
            "part = part - hole.translate(length / 2, -1, height / 2)\n"
            "cad.show(part)\n")  # fmt: skip
    # Each wall and the floor filled at half their thickness, the cavity empty from a quarter
    # of a wall beyond it (walls within 0.75-1.25 of `wall`), and the cable hole.
    up, tall = wall + 1, height - wall - 2
    column = lambda x, y, r: _cad_api.cylinder(tall, r).translate(x, y, up)  # noqa: E731
    probes = [
        ("front wall", "filled", column(length / 4, wall / 2, wall / 4)),
        ("back wall", "filled", column(length / 2, width - wall / 2, wall / 4)),
        ("left wall", "filled", column(wall / 2, width / 2, wall / 4)),
        ("right wall", "filled", column(length - wall / 2, width / 2, wall / 4)),
        ("floor", "filled", _cad_api.cylinder(0.8 * wall, 2).translate(
            length / 2, width / 2, 0.1 * wall)),
        ("cavity", "empty", column(length / 2, width / 2, 2)),
        ("front wall no thicker", "empty", column(length / 4, 1.5 * wall, wall / 4)),
        ("back wall no thicker", "empty", column(length / 2, width - 1.5 * wall, wall / 4)),
        ("left wall no thicker", "empty", column(1.5 * wall, width / 2, wall / 4)),
        ("right wall no thicker", "empty", column(length - 1.5 * wall, width / 2, wall / 4)),
        _hole("cable hole", wall, d, (length / 2, 0, height / 2), "y"),
    ]  # fmt: skip
    return text, code, 1, probes


def _hole(name: str, depth: float, diameter: float, at: tuple, axis: str = "z"):
    """A required through-hole as a probe that must be empty: a rod of a quarter of the hole's
    diameter along its axis, inside the `depth` it goes through (starting at `at`)."""
    rod = _cad_api.cylinder(0.8 * depth, diameter / 4).translate(0, 0, 0.1 * depth)
    if axis == "y":
        rod = rod.rotate(-90, 0, 0)
    return name, "empty", rod.translate(*at)


FAMILIES = {1: (_plate,), 2: (_bracket, _flange), 3: (_gear, _enclosure)}


def make_cad_task(seed: int, level: int = 1, aggregate: str = "gated") -> dict:
    """A `cad` prompt record: `prompt`, `reference` (a script that solves it), `target` (its
    construction tree), `holes`, `features` (the part's required features, each a probe solid
    that must be empty or filled: `_cad_geometry.Feature`), `aggregate` (how the reward's
    components make its total: `_cad_geometry.CAD_AGGREGATES`), `level`, `family` and `domain`."""
    if level not in FAMILIES:
        raise ValueError(f"level must be one of {sorted(FAMILIES)}, got {level}")
    rng = random.Random(f"cad-{level}-{seed}")
    family = rng.choice(FAMILIES[level])
    text, code, holes, probes = family(rng)
    features = [{"name": name, "kind": kind, "probe": probe.to_json()}
                for name, kind, probe in probes]  # fmt: skip
    return {
        "prompt": f"{text}\n{INSTRUCTIONS}",
        "reference": code,
        "target": script_tree(code),
        "holes": holes,
        "features": features,
        "aggregate": aggregate,
        "level": level,
        "family": family.__name__.lstrip("_"),
        "domain": "cad",
    }


def cad_sft_record(task: dict) -> dict:
    """A chat SFT example from a task: the prompt, and the reference script as the answer."""
    answer = f"```python\n{task['reference']}```"
    return {"messages": [{"role": "user", "content": task["prompt"]},
                         {"role": "assistant", "content": answer}], "domain": "cad"}  # fmt: skip
