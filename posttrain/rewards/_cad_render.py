"""Headless PNG renders of CAD parts, for a multimodal model's observation (the `cad`
environment) and for people reading eval reports: `render_views` draws a part in four
orthographic views as a third-angle drawing, `render_grid` several parts' isometric views.

Each view rotates the triangles of `solid.to_mesh()` and rasterises them with a depth buffer
(numpy, 2x supersampled); matplotlib's object-oriented API (no pyplot, display or global state)
lays out panels, labels and the PNG. mplot3d, by contrast, sorts whole triangles (a hole's far
wall gets drawn over the face in front of it) and fits the 3-D box (a thin plate's front view
is a sliver). Faces are shaded by their normal (Lambert plus ambient, one colour) and dimmed
with distance; dark lines mark where depth jumps or bends (outline, steps, holes). A solid
gives byte-identical PNGs (fixed DPI, no "Software" metadata).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np

DPI = 128  # a power of two: size_px / DPI inches is exact, so images are exactly size_px wide
PT = 72 / DPI  # points per pixel (font sizes)
SUPERSAMPLE = 2  # depth-buffer samples per pixel along each axis (antialiasing)
COLOUR = np.array([0.30, 0.52, 0.80])  # the part's colour under full light
AMBIENT = 0.35  # light that reaches faces turned away from the lamp
LIGHT = np.array([-1.0, 1.6, 2.2]) / math.sqrt(8.4)  # to the lamp (view space: right, up, viewer)
DEPTH_DIM = 0.35  # how much darker the farthest surface is than the nearest one
EDGE = 0.3  # brightness of feature lines, relative to the surface they cross
EDGE_PX = 1.5  # a depth jump or bend of more than this many samples' width is a line
MARGIN = 1.25  # a panel holds the part's projected extent times this
_ISO = np.array([[1.0, 1, 0], [-1, 1, 2], [1, -1, 1]])  # from +x, -y, +z
# Rows: screen right, screen up, towards the viewer (world: x right, y away, z up); grid order.
VIEWS = {
    "top (looking down -z)": np.eye(3),
    "isometric": _ISO / np.linalg.norm(_ISO, axis=1, keepdims=True),
    "front (looking along +y)": np.array([[1.0, 0, 0], [0, 0, 1], [0, -1, 0]]),
    "right (looking along -x)": np.array([[0.0, 1, 0], [0, 0, 1], [1, 0, 0]]),
}
PathLike = str | os.PathLike
Cell = tuple[str, object | None]  # (caption, solid or None)


def _triangles(solid) -> np.ndarray:
    """The solid's triangles, (T, 3 corners, xyz); none for an empty or missing solid."""
    if solid is None or solid.is_empty():
        return np.zeros((0, 3, 3))
    mesh = solid.to_mesh()
    return np.asarray(mesh.vert_properties, np.float64)[:, :3][np.asarray(mesh.tri_verts)]


def _extent(tris: np.ndarray, view: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(centre, size) of the triangles' projection in a view, in mm."""
    p = tris.reshape(-1, 3) @ view[:2].T
    return (p.min(0) + p.max(0)) / 2, np.maximum(p.max(0) - p.min(0), 1e-9)


def _fit(tris, view, w: int, h: int) -> float:
    """Pixels per mm at which the part's projection fills a w x h panel (with `MARGIN`)."""
    size = _extent(tris, view)[1] if len(tris) else np.ones(2)
    return float(min(w / size[0], h / size[1]) / MARGIN)


def _expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For items with `counts[i]` entries each: every entry's item and its index within it."""
    item = np.repeat(np.arange(len(counts)), counts)
    return item, np.arange(len(item)) - np.repeat(np.cumsum(counts) - counts, counts)


def _fragments(x, y, z, width: int, height: int):
    """Every sample each triangle covers, row by row: (sample index, depth, triangle)."""
    area = (x[:, 1] - x[:, 0]) * (y[:, 2] - y[:, 0]) - (y[:, 1] - y[:, 0]) * (x[:, 2] - x[:, 0])
    area = np.where(np.abs(area) > 1e-12, area, np.nan)  # edge-on: no samples
    dx, dy = np.roll(x, -1, 1) - x, np.roll(y, -1, 1) - y  # the edges
    dzdx = ((z[:, 1] - z[:, 0]) * (y[:, 2] - y[:, 0]) - (z[:, 2] - z[:, 0]) * dy[:, 0]) / area
    dzdy = ((z[:, 2] - z[:, 0]) * dx[:, 0] - (z[:, 1] - z[:, 0]) * (x[:, 2] - x[:, 0])) / area
    first = np.clip(np.ceil(y.min(1) - 0.5), 0, height)
    rows = np.clip(np.floor(y.max(1) - 0.5), -1, height - 1) - first + 1
    tri, k = _expand(np.where(np.isnan(area), 0, np.maximum(rows, 0)).astype(int))
    row = first[tri] + k
    with np.errstate(divide="ignore", invalid="ignore"):  # rows along a horizontal edge
        t = (row[:, None] + 0.5 - y[tri]) / dy[tri]
    across = x[tri] + t * dx[tri]
    inside = (t >= 0) & (t <= 1)
    left = np.ceil(np.where(inside, across, np.inf).min(1) - 0.5)
    right = np.floor(np.where(inside, across, -np.inf).max(1) - 0.5)
    left, right = np.clip(left, 0, width), np.clip(right, -1, width - 1)
    span, k = _expand(np.maximum(right - left + 1, 0).astype(int))
    col, tri, row = left[span] + k, tri[span], row[span]
    depth = z[tri, 0] + dzdx[tri] * (col + 0.5 - x[tri, 0]) + dzdy[tri] * (row + 0.5 - y[tri, 0])
    return (row * width + col).astype(int), depth, tri


def _rasterize(tris, view, scale: float, centre, width: int, height: int) -> np.ndarray:
    """The part seen through `view` at `scale` px/mm, `centre` (mm) in the middle: uint8 RGB."""
    n, h, w = SUPERSAMPLE, height * SUPERSAMPLE, width * SUPERSAMPLE  # in samples
    p = tris @ view.T
    normals = np.cross(p[:, 1] - p[:, 0], p[:, 2] - p[:, 0])
    p, normals = p[normals[:, 2] > 0], normals[normals[:, 2] > 0]  # back faces are hidden
    normals /= np.linalg.norm(normals, axis=1, keepdims=True)
    light = AMBIENT + (1 - AMBIENT) * np.clip(normals @ LIGHT, 0, 1)
    x = (p[..., 0] - centre[0]) * scale * n + w / 2
    y = h / 2 - (p[..., 1] - centre[1]) * scale * n  # rows go down
    zbuf, face = np.full((h, w), -np.inf), np.full((h, w), -1)
    sample, depth, tri = _fragments(x, y, p[..., 2], w, h)
    np.maximum.at(zbuf.reshape(-1), sample, depth)  # the nearest surface wins
    nearest = depth >= zbuf.reshape(-1)[sample]
    face.reshape(-1)[sample[nearest]] = tri[nearest]
    covered = face >= 0
    near, far = (p[..., 2].max(), p[..., 2].min()) if len(p) else (0.0, 0.0)
    dim = 1 - DEPTH_DIM * (near - zbuf) / max(near - far, 1e-9)
    rgb = np.where(covered[..., None], COLOUR * (light[face] * dim)[..., None], 1.0)
    # Lines where the depth's second difference is large: the outline, steps, creases.
    z = np.where(covered, zbuf, 2 * far - near - 1)
    line = np.zeros_like(covered)
    line[:, 1:-1] |= np.abs(z[:, 2:] - 2 * z[:, 1:-1] + z[:, :-2]) > EDGE_PX / (scale * n)
    line[1:-1] |= np.abs(z[2:] - 2 * z[1:-1] + z[:-2]) > EDGE_PX / (scale * n)
    rgb = np.where((line & covered)[..., None], rgb * EDGE, rgb)
    return np.round(rgb.reshape(height, n, width, n, 3).mean((1, 3)) * 255).astype(np.uint8)


def _figure(width_px: int, height_px: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    return FigureCanvasAgg(Figure(figsize=(width_px / DPI, height_px / DPI), dpi=DPI)).figure


def _panel(fig, box, solid, tris, view, scale: float | None, label: str, font: float):
    """A framed panel at `box` (x, y from the bottom, width, height; px): the part at `scale`
    px/mm (None: filling the panel), or why there is none; `label` in the top-left corner."""
    (x0, y0, w, h), (fw, fh) = box, fig.bbox.size
    ax = fig.add_axes((x0 / fw, y0 / fh, w / fw, h / fh), xticks=[], yticks=[])
    ax.spines[:].set_edgecolor("0.85")
    if len(tris):
        scale = scale or _fit(tris, view, w, h)
        image = _rasterize(tris, view, scale, _extent(tris, view)[0], w, h)
        ax.imshow(image, extent=(0, w, 0, h), interpolation="nearest", aspect="auto")
    else:
        ax.text(0.5, 0.5, "no part" if solid is None else "empty part", transform=ax.transAxes,
                ha="center", va="center", fontsize=font * PT, color="0.45")  # fmt: skip
    ax.text(0.03, 0.97, label, transform=ax.transAxes, va="top", fontsize=font * PT, color="0.3")


def _save(fig, path: PathLike) -> str:
    """Writes the figure as a PNG (no metadata that changes between runs); returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.canvas.print_png(os.fspath(path), metadata={"Software": None})
    return os.fspath(path)


def render_views(solid, path: PathLike, *, title: str = "", size_px: int = 512) -> str:
    """One PNG of a part in four orthographic views, as a third-angle drawing: the top view
    (looking down -z) above the front view (along +y) beside the right view (along -x), all
    three at one scale so sizes compare and features line up; the isometric view top-right.

    Args:
      solid: a `manifold3d.Manifold`; an empty one (or None) gives panels that say so.
      path: the PNG's local path (parent folders are created).
      title: a line over the views, e.g. the part's bounding box in mm.
      size_px: the image's width and height in pixels.

    Returns:
      `path`.
    """
    tris, fig = _triangles(solid), _figure(size_px, size_px)
    font = max(size_px / 40, 7.0)  # px
    band = round(2.2 * font) if title else 0
    fig.text(0.5, 1 - 0.4 * font / size_px, title, ha="center", va="top", fontsize=1.2 * font * PT)
    w, h = size_px // 2, (size_px - band) // 2
    scale = min(_fit(tris, v, w, h) for name, v in VIEWS.items() if name != "isometric")
    for i, (name, view) in enumerate(VIEWS.items()):
        own, box = None if name == "isometric" else scale, (i % 2 * w, (1 - i // 2) * h, w, h)
        _panel(fig, box, solid, tris, view, own, name, font)
    return _save(fig, path)


def render_grid(cells: Sequence[Cell], path: PathLike, *, columns: int, size_px: int = 256) -> str:
    """Isometric views of several parts in a grid, each under its caption.

    Args:
      cells: (caption, solid) per cell, row by row, e.g. ("task 3 · before · reward 0.41",
        part); a None solid gives a cell saying "no part", an empty one "empty part".
      path: the PNG's local path (parent folders are created).
      columns: cells per row.
      size_px: each cell's width and height in pixels (the image is columns x rows cells).

    Returns:
      `path`.
    """
    if columns < 1:
        raise ValueError(f"render_grid: columns must be >= 1, got {columns}")
    rows = max(math.ceil(len(cells) / columns), 1)
    fig = _figure(columns * size_px, rows * size_px)
    font, (fw, fh) = max(size_px / 22, 7.0), fig.bbox.size  # px
    band = round(1.8 * font)  # the caption's
    for i, (caption, solid) in enumerate(cells):
        x0, y0 = i % columns * size_px, (rows - 1 - i // columns) * size_px
        at = ((x0 + size_px / 2) / fw, (y0 + size_px - 0.3 * font) / fh)
        fig.text(*at, caption, ha="center", va="top", fontsize=font * PT)
        box = (x0, y0, size_px, size_px - band)
        _panel(fig, box, solid, _triangles(solid), VIEWS["isometric"], None, "", font)
    return _save(fig, path)
