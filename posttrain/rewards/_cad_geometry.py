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

- `features` (when the task lists required features): the share of them present. A feature
  is a probe solid in the target's frame that the part must leave empty (a hole, a gap between
  gear teeth, a cavity) or fill (a tooth, a wall): present when the part overlaps less than
  `EMPTY` (or more than `FILLED`) of the probe's volume.

and `total`: with `task.aggregate == "mean"` the weighted mean of the components with
`task.weights` (`DEFAULT_WEIGHTS`); with "gated" the same mean, capped at `task.cap` when the
part misses a required feature (invalid, a wrong through-hole count, or a feature probe not
present), so no part without its holes, teeth or walls scores above a part that has them and
fits worse.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from posttrain.rewards._cad_holes import topology

BASE_TOLERANCE = 1e-6  # vertices this close to the lowest z (relative to the height) are the base
DEFAULT_WEIGHTS = {"valid": 1.0, "iou": 4.0, "dimensions": 2.0, "holes": 1.0,
                   "single_body": 1.0, "stable": 1.0}  # fmt: skip
CAD_AGGREGATES = ("mean", "gated")
GATE_CAP = 0.25  # a gated total's ceiling while a required feature is missing
EMPTY, FILLED = 0.1, 0.9  # probe overlap at most / at least, for a feature to be present


@dataclasses.dataclass(frozen=True)
class Feature:
    """A required feature: `probe` (a construction tree in the target's frame) must be left
    "empty" (a hole, a gap, a cavity) or "filled" (a tooth, a wall) by the part."""

    name: str
    kind: str
    probe: dict

    def __post_init__(self):
        if self.kind not in ("empty", "filled"):
            raise ValueError(f"feature {self.name!r}: kind {self.kind!r}, use empty or filled")


@dataclasses.dataclass(frozen=True)
class CADTask:
    """What a candidate is scored against besides the target solid."""

    holes: int | None = None  # through-holes the part must have (None: not checked)
    tolerance: float = 0.02  # relative tolerance on each bounding-box extent
    weights: tuple[tuple[str, float], ...] = tuple(DEFAULT_WEIGHTS.items())
    features: tuple[Feature, ...] = ()  # required features (probes)
    aggregate: str = "mean"  # one of CAD_AGGREGATES
    cap: float = GATE_CAP  # "gated": the total's ceiling while a required feature is missing

    def __post_init__(self):
        if self.aggregate not in CAD_AGGREGATES:
            raise ValueError(f"aggregate={self.aggregate!r}: use one of {CAD_AGGREGATES}")


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


def features_present(solid, features) -> dict[str, bool]:
    """Which of the required `features` a (valid) solid has (see `Feature`)."""
    from posttrain.rewards._cad_kernel import build

    present = {}
    for feature in features:
        probe = build(feature.probe)
        overlap = (solid ^ probe).volume() / max(probe.volume(), 1e-12)
        present[feature.name] = overlap <= EMPTY if feature.kind == "empty" else overlap >= FILLED
    return present


def score(candidate, target, task: CADTask = CADTask()) -> dict[str, float]:
    """The reward components of `candidate` against `target` (see the module docstring)."""
    got = measure(candidate)
    fit = iou(candidate, target) if got.valid else 0.0
    present = features_present(candidate, task.features) if got.valid else {}
    return score_measured(got, measure(target) if got.valid else got, fit, task, present)


def score_measured(
    got: Measurements,
    want: Measurements,
    fit: float,
    task: CADTask = CADTask(),
    present: dict[str, bool] | None = None,
) -> dict[str, float]:
    """`score` from measurements: the candidate's, the target's, their IoU and which of the
    task's features the candidate has (`features_present`)."""
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
    out = {k: parts[k] for k in weights}
    complete = got.valid and (task.holes is None or got.holes == task.holes)
    if task.features:
        have = [got.valid and (present or {}).get(f.name, False) for f in task.features]
        out["features"] = sum(have) / len(have)
        complete &= all(have)
    if task.aggregate == "gated" and not complete:
        total = min(total, task.cap)
    return {**out, "total": total}
