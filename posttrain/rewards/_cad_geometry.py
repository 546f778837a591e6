"""What a CAD reward measures on a solid (a `manifold3d.Manifold`), and the scores it gives.

Every measure is exact or deterministic: volumes and the target overlap come from the geometry
kernel's booleans (volumetric IoU = vol(A ∩ B) / vol(A ∪ B), no voxels), through-holes from the
topology of the surface (`_cad_holes`: the genus, except that bores which cross count one each,
not as the three loops two crossing bores make), bodies from its connected components, and
stability from the centre of mass (signed tetrahedra of the triangle mesh) over the support
polygon (the convex hull of the vertices within `BASE_TOLERANCE` of the lowest point).

`score(candidate, target, task)` (or `score_measured` from measurements taken elsewhere)
returns named components in [0, 1]:

- `valid`: the solid is non-empty and the kernel reports no error.
- `iou`: volumetric IoU with the target (0 when invalid).
- `dimensions`: share of the bounding box's extents within `task.tolerance` (relative) of the
  target's.
- `holes`: 1 if the number of through-holes equals the task's, else 0 (None in the task: 1).
- `single_body`: 1 if the solid is one connected body.
- `stable`: 1 if the solid rests on its lowest face without tipping.

and `total`, their weighted mean with `task.weights` (`DEFAULT_WEIGHTS`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from posttrain.rewards._cad_holes import topology

BASE_TOLERANCE = 1e-6  # vertices this close to the lowest z (relative to the height) are the base
DEFAULT_WEIGHTS = {"valid": 1.0, "iou": 4.0, "dimensions": 2.0, "holes": 1.0,
                   "single_body": 1.0, "stable": 1.0}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CADTask:
    """What a candidate is scored against besides the target solid."""

    holes: int | None = None  # through-holes the part must have (None: not checked)
    tolerance: float = 0.02  # relative tolerance on each bounding-box extent
    weights: tuple[tuple[str, float], ...] = tuple(DEFAULT_WEIGHTS.items())


@dataclasses.dataclass(frozen=True)
class Measurements:
    """A solid's measures (what a CAD environment reports back as text)."""

    valid: bool
    volume: float
    surface_area: float
    extents: tuple[float, float, float]  # bounding-box size along x, y, z
    bodies: int  # connected closed surfaces (as `Manifold.decompose` splits them)
    holes: int  # through-holes (`_cad_holes.topology`), summed over bodies
    centre_of_mass: tuple[float, float, float]
    stable: bool


def _is_valid(solid) -> bool:
    import manifold3d

    return (not solid.is_empty()) and solid.status() == manifold3d.Error.NoError


def centre_of_mass(solid) -> np.ndarray:
    """The centroid of the solid's volume (uniform density), from signed tetrahedra."""
    mesh = solid.to_mesh()
    v = np.asarray(mesh.vert_properties, np.float64)[:, :3]
    a, b, c = (v[np.asarray(mesh.tri_verts)[:, k]] for k in range(3))
    volumes = np.einsum("ij,ij->i", a, np.cross(b, c)) / 6.0
    return (volumes[:, None] * (a + b + c) / 4.0).sum(0) / volumes.sum()


def _inside_hull(point: np.ndarray, points: np.ndarray) -> bool:
    """Whether a 2-D point lies inside (or on) the convex hull of 2-D points."""
    from scipy.spatial import ConvexHull, QhullError

    try:
        hull = ConvexHull(points)
    except QhullError:  # fewer than 3 non-collinear base points: a line or a point of contact
        return False
    # Each facet: normal . x + offset <= 0 inside.
    return bool(np.all(hull.equations[:, :2] @ point + hull.equations[:, 2] <= 1e-9))


def is_stable(solid) -> bool:
    """Whether the solid, set down on a table, rests without tipping: its centre of mass lies
    over the support polygon of its lowest vertices."""
    mesh = solid.to_mesh()
    v = np.asarray(mesh.vert_properties, np.float64)[:, :3]
    low, high = v[:, 2].min(), v[:, 2].max()
    base = v[v[:, 2] <= low + BASE_TOLERANCE * max(high - low, 1.0), :2]
    return _inside_hull(centre_of_mass(solid)[:2], base)


def measure(solid) -> Measurements:
    """The measures of `solid` (an invalid or empty one: zeros)."""
    if not _is_valid(solid):
        return Measurements(False, 0.0, 0.0, (0.0, 0.0, 0.0), 0, 0, (0.0, 0.0, 0.0), False)
    lo, hi = np.split(np.asarray(solid.bounding_box(), np.float64), 2)
    surfaces = topology(solid)
    return Measurements(
        valid=True,
        volume=float(solid.volume()),
        surface_area=float(solid.surface_area()),
        extents=tuple(float(x) for x in hi - lo),
        bodies=surfaces.surfaces,
        holes=surfaces.holes,
        centre_of_mass=tuple(float(x) for x in centre_of_mass(solid)),
        stable=is_stable(solid),
    )


def iou(a, b) -> float:
    """Volumetric intersection over union of two solids (exact, by the kernel's booleans)."""
    union = (a + b).volume()
    return float((a ^ b).volume() / union) if union > 0 else 0.0


def score(candidate, target, task: CADTask = CADTask()) -> dict[str, float]:
    """The reward components of `candidate` against `target` (see the module docstring)."""
    got = measure(candidate)
    fit = iou(candidate, target) if got.valid else 0.0
    return score_measured(got, measure(target) if got.valid else got, fit, task)


def score_measured(
    got: Measurements, want: Measurements, fit: float, task: CADTask = CADTask()
) -> dict[str, float]:
    """`score` from measurements: the candidate's, the target's and their IoU."""
    weights = dict(task.weights)
    if not got.valid:
        parts = dict.fromkeys(weights, 0.0)
    else:
        within = [
            abs(g - w) <= task.tolerance * max(w, 1e-9)
            for g, w in zip(got.extents, want.extents, strict=True)
        ]
        parts = {
            "valid": 1.0,
            "iou": fit,
            "dimensions": sum(within) / 3.0,
            "holes": float(task.holes is None or got.holes == task.holes),
            "single_body": float(got.bodies == 1),
            "stable": float(got.stable),
        }
    total = sum(weights[k] * parts[k] for k in weights) / math.fsum(weights.values())
    return {**{k: parts[k] for k in weights}, "total": total}
