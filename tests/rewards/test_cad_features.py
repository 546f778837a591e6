"""Gated CAD rewards: each generated task lists its required features (holes where the text
puts them, gear teeth and the gaps between them, walls of the stated thickness, the cavity);
the reference has every one, and a part missing any one is capped at `GATE_CAP`, however well
it fits otherwise, where the weighted mean ("mean", kept as an option) scored it high."""

import re

import pytest

from posttrain.rewards._cad import build, cad_task
from posttrain.rewards._cad_geometry import GATE_CAP, features_present, score
from posttrain.rewards._cad_tasks import FAMILIES, make_cad_task, script_tree


def _task(family: str, level: int) -> dict:
    return next(t for s in range(50) if (t := make_cad_task(s, level))["family"] == family)


def _scores(task: dict, code: str) -> tuple[dict, dict]:
    """(gated, mean) components of the part `code` builds, against the task's target."""
    part, target = build(script_tree(code)), build(task["target"])
    gated = score(part, target, cad_task(task))
    return gated, score(part, target, cad_task({**task, "aggregate": "mean"}))


@pytest.mark.parametrize("level", sorted(FAMILIES))
def test_every_reference_has_every_required_feature(level):
    for seed in range(4):
        task = make_cad_task(seed, level)
        gated, mean = _scores(task, task["reference"])
        assert gated["features"] == 1.0 and gated["total"] == pytest.approx(1.0), task["family"]
        assert mean["total"] == pytest.approx(1.0)


def _sub(pattern: str, repl, code: str) -> str:
    out, n = re.subn(pattern, repl, code)
    assert n, (pattern, code)
    return out


def _fewer_teeth(code: str) -> str:
    return _sub(r"teeth, depth, root = (\d+)",
                lambda m: f"teeth, depth, root = {int(m.group(1)) - 1}", code)  # fmt: skip


def _toothless(code: str) -> str:  # a disk out to the teeth's tips
    return _sub(r"cad\.extrude\(points, thickness\)", "cad.cylinder(thickness, tip, 96)", code)


def _thicker_walls(code: str) -> str:  # the cavity a wall narrower on every side
    return _sub(r"- 2 \* wall, width - 2 \* wall, height\)\.translate\(wall, wall,",
                "- 4 * wall, width - 4 * wall, height).translate(2 * wall, 2 * wall,",
                code)  # fmt: skip


PLATE, GEAR, ENCLOSURE = _task("plate", 1), _task("gear", 3), _task("enclosure", 3)
UNCUT = lambda code: _sub(r" *part = part - hole.*\n", "", code)  # noqa: E731

# Each: a task, a part that lacks required features and fits well otherwise, and the start of
# the name of every feature it misses.
FIXTURES = {
    # The CAD demo's plate with no holes (0.89 under the mean).
    "plate without its holes": (PLATE, UNCUT, ["hole at x"]),
    # As many holes, in the wrong places: the hole count alone is satisfied.
    "plate with its holes moved": (PLATE, lambda c: _sub(r"translate\(x,", "translate(x + 8,", c),
                                   ["hole at x"]),
    # A disk as wide as the teeth: every gap filled.
    "gear without teeth": (GEAR, _toothless, ["gap after"]),
    "gear with a tooth fewer": (GEAR, _fewer_teeth, ["tooth", "gap after"]),
    "enclosure with walls twice as thick": (ENCLOSURE, _thicker_walls,
                                            ["front wall no", "back wall no", "left wall no",
                                             "right wall no"]),
    "enclosure without its cable hole": (ENCLOSURE, UNCUT, ["cable hole"]),
}  # fmt: skip


@pytest.mark.parametrize("name", FIXTURES)
def test_a_part_missing_a_required_feature_is_capped(name):
    task, change, missing = FIXTURES[name]
    gated, mean = _scores(task, change(task["reference"]))
    part = build(script_tree(change(task["reference"])))
    lacks = [f for f, ok in features_present(part, cad_task(task).features).items() if not ok]
    assert lacks and all(any(f.startswith(m) for m in missing) for f in lacks), lacks
    assert all(any(f.startswith(m) for f in lacks) for m in missing), (missing, lacks)
    assert gated["features"] < 1.0 and gated["total"] <= GATE_CAP
    assert mean["total"] > 2 * GATE_CAP, mean  # what the weighted mean let through


def test_pointed_teeth_in_the_right_number_and_places_keep_every_feature():
    """The gate checks the teeth are there, not their profile: triangular teeth cost IoU and
    dimensions under both totals, never the cap."""
    pointed = _sub(re.escape("(-w / 4, tip), (w / 4, tip)"), "(0, tip)", GEAR["reference"])
    gated, mean = _scores(GEAR, pointed)
    assert gated["features"] == 1.0 and gated["iou"] < 1.0
    assert gated["total"] == mean["total"] > GATE_CAP
