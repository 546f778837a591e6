"""CAD renders: a through-hole shows as background exactly where the geometry puts it, the views
keep true proportions and line up, output is byte-identical and sized as asked, and a missing
or empty part draws a labelled empty panel instead of raising."""

import manifold3d
import numpy as np
import pytest
from PIL import Image

from posttrain.rewards._cad import build
from posttrain.rewards._cad_render import render_grid, render_views
from posttrain.rewards._cad_tasks import script_tree

PLATE = "import cad\npart = cad.box(40, 20, 4)\n"
HOLE = "part = part - cad.cylinder(6, 3).translate(10, 10, -1)\n"  # centre (10, 10), r = 3


def _part(code: str):
    return build(script_tree(code + "cad.show(part)\n"))


def _pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"), np.int32)


def _is_part(rgb: np.ndarray) -> np.ndarray:
    """The part's blue (the background is white, labels grey)."""
    return rgb[..., 2] - rgb[..., 0] > 40


def _blobs(mask: np.ndarray) -> list[tuple[int, int, int, int]]:
    """(first row, last row, first column, last column) of each band of rows holding the part."""
    rows = np.flatnonzero(mask.any(1))
    bands = np.split(rows, np.flatnonzero(np.diff(rows) > 1) + 1)
    return [(b[0], b[-1], *np.flatnonzero(mask[b[0] : b[-1] + 1].any(0))[[0, -1]]) for b in bands]


@pytest.fixture(scope="module")
def plates(tmp_path_factory):
    root = tmp_path_factory.mktemp("render")
    solid = render_views(_part(PLATE), root / "solid.png", title="40 x 20 x 4 mm", size_px=400)
    holed = render_views(_part(PLATE + HOLE), root / "holed.png", title="40 x 20 x 4 mm",
                         size_px=400)  # fmt: skip
    return root, _pixels(solid), _pixels(holed)


def test_the_hole_shows_where_the_geometry_puts_it(plates):
    _, solid, holed = plates
    left = slice(0, 200)  # the top view above the front view
    (top, front) = _blobs(_is_part(solid[:, left]))
    r0, r1, c0, c1 = top
    assert (c1 - c0) / (r1 - r0) == pytest.approx(40 / 20, rel=0.05)  # true proportions
    assert (front[3] - front[2]) / (front[1] - front[0]) == pytest.approx(40 / 4, rel=0.15)
    assert abs(front[2] - c0) <= 1 and abs(front[3] - c1) <= 1  # one scale, lined up
    mm = (c1 - c0) / 40  # px per mm
    row, col = round(r0 + (20 - 10) * mm), round(c0 + 10 * mm)  # y = 10 mm, up the image
    assert _is_part(solid[row, col]) and (holed[row, col] > 245).all()  # background
    changed = np.argwhere(np.abs(holed[:, left] - solid[:, left]).max(-1) > 30)
    assert len(changed) > (2.5 * mm) ** 2  # most of the hole's disc
    assert np.hypot(changed[:, 0] - row, changed[:, 1] - col).max() <= 3 * mm + 2
    for r0, r1, _, _ in (front, _blobs(_is_part(solid[:, 200:]))[1]):  # front, right views
        assert (holed[r0 - 3 : r1 + 4] == solid[r0 - 3 : r1 + 4]).all()  # show no hole


def test_output_is_byte_identical_and_sized_as_asked(plates, tmp_path):
    root, _, _ = plates
    again = render_views(
        _part(PLATE), tmp_path / "a" / "b.png", title="40 x 20 x 4 mm", size_px=400
    )
    assert open(again, "rb").read() == open(root / "solid.png", "rb").read()
    odd = render_views(_part(PLATE), tmp_path / "odd.png", size_px=301)
    assert Image.open(odd).size == (301, 301)
    cells = [("a", _part(PLATE)), ("b", None), ("c", _part(PLATE + HOLE))]
    grid = render_grid(cells, tmp_path / "grid.png", columns=2, size_px=96)
    assert Image.open(grid).size == (192, 192)
    pixels = _pixels(grid)
    assert _is_part(pixels[:96, :96]).any() and _is_part(pixels[96:, :96]).any()
    assert not _is_part(pixels[:96, 96:]).any() and not _is_part(pixels[96:, 96:]).any()


def test_an_empty_or_missing_part_draws_an_empty_labelled_image(tmp_path):
    for solid in (manifold3d.Manifold(), None):
        pixels = _pixels(render_views(solid, tmp_path / "empty.png", title="nothing", size_px=128))
        assert pixels.shape == (128, 128, 3) and not _is_part(pixels).any()
        assert (pixels < 200).any()  # the labels
    pixels = _pixels(render_grid([("no part", None)], tmp_path / "none.png", columns=3))
    assert pixels.shape == (256, 3 * 256, 3) and not _is_part(pixels).any()
    with pytest.raises(ValueError, match="columns"):
        render_grid([], tmp_path / "bad.png", columns=0)
