"""CAD reward components on fixtures: a reference part scores 1 on itself, each known
perturbation lowers exactly the components it should, by amounts computed here from the
kernel's exact volumes, and through-holes are counted as bores, not as loops of the surface."""

import manifold3d as m3d
import pytest

from posttrain.rewards._cad_geometry import DEFAULT_WEIGHTS, CADTask, measure, score
from posttrain.rewards._cad_holes import topology

TASK = CADTask(holes=2, tolerance=0.02)
WEIGHT = sum(DEFAULT_WEIGHTS.values())


def _plate(length=40.0, holes=((10.0, 10.0), (30.0, 10.0))):
    """A 40 x 20 x 4 plate with 6 mm through-holes."""
    solid = m3d.Manifold.cube([length, 20.0, 4.0])
    for x, y in holes:
        solid = solid - m3d.Manifold.cylinder(6.0, 3.0, 3.0, 48).translate([x, y, -1.0])
    return solid


def _total(parts: dict) -> float:
    return sum(DEFAULT_WEIGHTS[k] * parts[k] for k in DEFAULT_WEIGHTS) / WEIGHT


def test_the_reference_scores_one_on_itself_and_scores_are_deterministic():
    target = _plate()
    got = score(_plate(), target, TASK)
    assert got == {**dict.fromkeys(DEFAULT_WEIGHTS, 1.0), "total": 1.0}
    assert score(_plate(), target, TASK) == got
    m = measure(target)
    assert (m.bodies, m.holes, m.stable) == (1, 2, True)
    assert m.extents == pytest.approx((40.0, 20.0, 4.0))


def test_a_dimension_10_percent_long_costs_one_extent_and_the_extra_volume():
    target, long = _plate(), _plate(length=44.0)
    got = score(long, target, TASK)
    assert got["dimensions"] == pytest.approx(2 / 3)  # length out of tolerance, width and height in
    assert got["iou"] == pytest.approx(target.volume() / long.volume())  # the target is inside it
    assert (got["valid"], got["holes"], got["single_body"], got["stable"]) == (1, 1, 1, 1)
    assert got["total"] == pytest.approx(_total(got)) and got["total"] < 1


def test_a_missing_hole_costs_the_hole_count_and_its_volume():
    target, one_hole = _plate(), _plate(holes=((10.0, 10.0),))
    got = score(one_hole, target, TASK)
    assert got["holes"] == 0 and got["dimensions"] == 1 and got["single_body"] == 1
    assert got["iou"] == pytest.approx(target.volume() / one_hole.volume())
    assert measure(one_hole).holes == 1


def test_a_disconnected_part_costs_single_body():
    target = _plate()
    stray = m3d.Manifold.cube([2.0, 2.0, 2.0]).translate([10.0, 10.0, 20.0])  # above a hole
    got = score(_plate() + stray, target, TASK)
    assert got["single_body"] == 0 and measure(_plate() + stray).bodies == 2
    assert got["iou"] == pytest.approx(target.volume() / (target.volume() + 8.0))
    assert got["holes"] == 1 and got["stable"] == 1  # the stray cube sits above the footprint


def test_a_shape_that_tips_over_is_not_stable():
    stem = m3d.Manifold.cube([2.0, 4.0, 6.0])
    arm = m3d.Manifold.cube([20.0, 4.0, 2.0]).translate([0.0, 0.0, 6.0])  # overhangs to +x
    tipping = stem + arm
    assert measure(tipping).centre_of_mass[0] > 2.0  # over empty space, beside the stem
    got = score(tipping, tipping, CADTask())
    assert got["stable"] == 0 and got["iou"] == 1 and got["single_body"] == 1
    assert got["total"] == pytest.approx(1 - DEFAULT_WEIGHTS["stable"] / WEIGHT)


def test_an_empty_result_scores_zero_everywhere():
    got = score(m3d.Manifold(), _plate(), TASK)
    assert got == {**dict.fromkeys(DEFAULT_WEIGHTS, 0.0), "total": 0.0}


def test_a_non_manifold_edge_costs_single_body():
    # Two cubes sharing only an edge: the textbook non-manifold solid. The kernel keeps every
    # result 2-manifold by splitting such an edge, so it reads as two bodies touching there.
    cube = m3d.Manifold.cube([10.0, 10.0, 10.0])
    edge_joined = cube + cube.translate([10.0, 10.0, 0.0])
    assert measure(edge_joined).bodies == 2
    got = score(edge_joined, edge_joined, CADTask())
    assert got["single_body"] == 0 and got["iou"] == 1 and got["valid"] == 1
    assert got["total"] == pytest.approx(1 - DEFAULT_WEIGHTS["single_body"] / WEIGHT)


def _block():
    return m3d.Manifold.cube([20.0, 20.0, 20.0])


def _bore(axis: str, a: float = 10.0, b: float = 10.0, radius: float = 3.0, length=24.0):
    """A 6 mm bore along `axis` through the 20 mm block, at (a, b) across it."""
    rod = m3d.Manifold.cylinder(length, radius, radius, 48)
    if axis == "z":
        return rod.translate([a, b, -2.0])
    if axis == "x":
        return rod.rotate([0.0, 90.0, 0.0]).translate([-2.0, a, b])
    return rod.rotate([-90.0, 0.0, 0.0]).translate([a, -2.0, b])


HOLES = {  # name: (part, through-holes, genus)
    "a plain block": (_block, 0, 0),
    "one bore": (lambda: _block() - _bore("z"), 1, 1),
    "two parallel bores": (lambda: _block() - _bore("z", 6.0) - _bore("z", 14.0), 2, 2),
    "two crossing bores": (lambda: _block() - _bore("x") - _bore("y"), 2, 3),
    "crossing bores of two sizes": (lambda: _block() - _bore("x") - _bore("y", radius=2), 2, 3),
    "three bores crossing at the centre": (
        lambda: _block() - _bore("x") - _bore("y") - _bore("z"), 3, 5),
    "two crossing and one apart": (
        lambda: _block() - _bore("x") - _bore("y") - _bore("z", 4.0, 4.0), 3, 4),
    "a bore ending in another": (
        lambda: _block() - _bore("x") - _bore("z", radius=2.0, length=12.0).translate(
            [0.0, 0.0, 12.0]), 2, 2),
    "two bores passing one above the other": (
        lambda: _block() - _bore("x", b=6.0) - _bore("y", b=14.0), 2, 2),
    "an open box with a hole in a wall": (
        lambda: _block() - m3d.Manifold.cube([16.0, 16.0, 20.0]).translate([2.0, 2.0, 2.0])
        - _bore("y", b=10.0, length=6.0).translate([0.0, -1.0, 0.0]), 1, 1),
}  # fmt: skip


@pytest.mark.parametrize("name", list(HOLES))
def test_through_holes_count_bores_not_loops_of_the_surface(name):
    make, holes, genus = HOLES[name]
    part = make()
    got = topology(part)
    assert (got.holes, got.genus, got.surfaces) == (holes, genus, 1)
    assert measure(part).holes == holes
    assert topology(part.rotate([31.0, -47.0, 12.0]).scale([0.3, 0.3, 0.3])).holes == holes


def test_crossing_bores_score_as_two_holes():
    crossing = _block() - _bore("x") - _bore("y")
    got = score(crossing, crossing, CADTask(holes=2))
    assert got["holes"] == 1 and got["total"] == pytest.approx(1.0)
    assert score(crossing, crossing, CADTask(holes=3))["holes"] == 0  # (the genus: 3)


def test_bores_crossing_inside_a_round_shaft_count_as_the_genus():
    """The documented limit: openings are found on flat faces only, so bores that cross in a
    round shaft, opening onto its curved side, count as the genus does (3), not as 2."""
    shaft = m3d.Manifold.cylinder(30.0, 8.0, 8.0, 64)
    across = m3d.Manifold.cylinder(24.0, 2.0, 2.0, 48).rotate([0.0, 90.0, 0.0])
    part = (
        shaft
        - across.translate([-12.0, 0.0, 15.0])
        - across.rotate([0.0, 0.0, 90.0]).translate([0.0, -12.0, 15.0])
    )
    assert topology(part).genus == 3 and topology(part).holes == 3
