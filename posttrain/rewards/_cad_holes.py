"""Through-holes of a solid, counted the way a drawing counts them: two bores that cross are two
holes, where the genus of the surface says three.

The genus counts independent loops: a passage that opens onto the part at k places adds k - 1
to it (one straight bore: 1; two crossing bores, one passage with 4 openings: 3). Here a
passage with k openings counts ceil(k / 2) instead (2 for the crossing bores, 3 for three bores
crossing at one point; a bore that ends in another, 3 openings, stays 2), and everything else
counts as the genus does.

Openings are found on the triangle mesh. A face is a connected set of coplanar triangles; an
opening ("rim") is an inner boundary loop of a face across which the surface turns into the
material (a hole's wall going down, not a boss standing up). Cutting the surface along every
rim leaves pieces joined by rims, and the genus is exactly the cycle count of that graph plus
the pieces' own genera. A passage is a piece of genus 0 that only ever lies on the inner side
of its rims (the bores' walls, away from the faces they open onto). The rule needs openings on
flat faces: where a passage opens onto a curved surface (a cross-drilled round shaft) no rim is
found there and it counts as the genus does; so does any mesh where the pieces do not add up to
the genus.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

COPLANAR = 1e-8  # 1 - cos(angle) below which adjacent triangles share a face (~0.008 degrees)


@dataclasses.dataclass(frozen=True)
class Topology:
    """What the connectivity of a solid's surface says."""

    surfaces: int  # closed surfaces (a body; a sealed void inside one adds another)
    genus: int  # summed over the surfaces
    holes: int  # through-holes: the genus, with each passage counted ceil(openings / 2)


def topology(solid) -> Topology:
    """The surfaces, genus and through-holes of a solid (see the module docstring)."""
    mesh = _Mesh(solid)
    total = mesh.genus() if mesh.ok else None
    if total is None:  # not a closed 2-manifold mesh (the kernel's always is): ask the kernel
        bodies = solid.decompose()
        total = sum(b.genus() for b in bodies)
        return Topology(len(bodies), total, total)
    holes = total - mesh.junction_excess(total) if total >= 3 else total
    return Topology(int(mesh.components.max(initial=-1)) + 1, total, holes)


class _Mesh:
    """A closed triangle mesh with its half-edges paired."""

    def __init__(self, solid):
        from scipy.sparse import coo_matrix
        from scipy.sparse.csgraph import connected_components

        mesh = solid.to_mesh64()
        self.v = np.asarray(mesh.vert_properties, np.float64)[:, :3]
        tri = np.asarray(mesh.tri_verts, np.int64).reshape(-1, 3)
        merge_from = np.asarray(mesh.merge_from_vert, np.int64)
        if merge_from.size:  # vertices split for properties: one index per position
            remap = np.arange(len(self.v))
            remap[merge_from] = np.asarray(mesh.merge_to_vert, np.int64)
            tri = remap[tri]
        self.tri, nt = tri, len(tri)
        # Half-edge h = 3 * t + k runs from tri[t, k] to tri[t, k + 1].
        self.start = tri.reshape(-1)
        self.end = tri[:, [1, 2, 0]].reshape(-1)
        n = max(len(self.v), 1)
        key, twin_key = self.start * n + self.end, self.end * n + self.start
        order = np.argsort(key)
        ordered = key[order]
        pos = np.clip(np.searchsorted(ordered, twin_key), 0, max(len(key) - 1, 0))
        self.twin = order[pos] if len(key) else pos
        self.ok = bool(
            len(key)
            and np.array_equal(key[self.twin], twin_key)
            and not np.any(ordered[1:] == ordered[:-1])  # each directed edge once
        )
        self.ntri = nt
        self.components = np.zeros(0, np.int64)
        if not self.ok:
            return
        h = np.arange(3 * nt)
        adj = coo_matrix((np.ones(3 * nt), (h // 3, self.twin // 3)), shape=(nt, nt))
        self.components = connected_components(adj, directed=False)[1].astype(np.int64)
        self._cc = connected_components

    def genus(self) -> int | None:
        """Summed over the closed surfaces; None if one's Euler characteristic is odd."""
        genera = self._piece_genus(self.components, np.zeros(3 * self.ntri, bool), {})
        return None if genera.min() < 0 else int(genera.sum())

    def _piece_genus(self, label: np.ndarray, cut: np.ndarray, loops: dict) -> np.ndarray:
        """Per piece, the genus of the surface cut along the half-edges `cut` (each triangle's
        piece in `label`; `loops[piece]` boundary loops); -1 where the counts do not fit."""
        n = int(label.max()) + 1
        tris = np.bincount(label, minlength=n)
        n_cut = np.bincount(np.repeat(label, 3), weights=cut, minlength=n).astype(np.int64)
        edges = (3 * tris - n_cut) // 2 + n_cut
        verts = np.bincount(_distinct_pairs(np.repeat(label, 3), self.tri.reshape(-1)), minlength=n)
        g2 = 2 - (verts - edges + tris) - np.array([loops.get(p, 0) for p in range(n)])
        return np.where((g2 >= 0) & (g2 % 2 == 0), g2 // 2, -1)

    def junction_excess(self, total: int) -> int:
        """How much more than ceil(k / 2) the passages with k openings add to the genus."""
        rims = self._rims()
        if len(rims) < 3:
            return 0
        from scipy.sparse import coo_matrix

        cut = np.zeros(3 * self.ntri, bool)
        for face_side in rims:
            cut[face_side] = True
            cut[self.twin[face_side]] = True
        h = np.flatnonzero(~cut)
        nt = self.ntri
        adj = coo_matrix((np.ones(len(h)), (h // 3, self.twin[h] // 3)), shape=(nt, nt))
        piece = self._cc(adj, directed=False)[1].astype(np.int64)
        links = []  # (piece on the face's side, piece on the wall's side) per rim
        for face_side in rims:
            faces, walls = set(piece[face_side // 3]), set(piece[self.twin[face_side] // 3])
            if len(faces) != 1 or len(walls) != 1 or faces == walls:
                return 0
            links.append((faces.pop(), walls.pop()))
        degree: dict[int, int] = {}
        for a, b in links:
            degree[a] = degree.get(a, 0) + 1
            degree[b] = degree.get(b, 0) + 1
        genera = self._piece_genus(piece, cut, degree)
        pieces = set(range(len(genera)))
        if genera.min() < 0 or _cycles(links, pieces) + int(genera.sum()) != total:
            return 0  # the pieces do not add up to the genus: leave it as it is
        excess = 0
        for p in pieces:
            k = degree.get(p, 0)
            if genera[p] or k < 4 or any(a == p for a, _ in links):
                continue  # not a passage, or one whose count the genus already gives
            rest = [(a, b) for a, b in links if p not in (a, b)]
            adds = _cycles(links, pieces) - _cycles(rest, pieces - {p})
            excess += max(0, adds - math.ceil(k / 2))
        return excess

    def _rims(self) -> list[np.ndarray]:
        """The face-side half-edges of each rim: an inner boundary loop of a flat face whose
        other side turns into the material."""
        from scipy.sparse import coo_matrix

        a, b, c = (self.v[self.tri[:, k]] for k in range(3))
        normal = np.cross(b - a, c - a)
        length = np.linalg.norm(normal, axis=1, keepdims=True)
        normal = np.divide(normal, length, out=np.zeros_like(normal), where=length > 0)
        tri_of, twin_tri = np.arange(3 * self.ntri) // 3, self.twin // 3
        flat = (normal[tri_of] * normal[twin_tri]).sum(1) > 1 - COPLANAR
        h = np.flatnonzero(flat)
        nt = self.ntri
        adj = coo_matrix((np.ones(len(h)), (tri_of[h], twin_tri[h])), shape=(nt, nt))
        face = self._cc(adj, directed=False)[1].astype(np.int64)
        boundary = np.flatnonzero(~flat)
        # A flat face with h holes has Euler characteristic 1 - h: look only at those below 1.
        counts = np.bincount(face, minlength=face.max() + 1)
        per_face_h = np.bincount(face[tri_of[boundary]], minlength=len(counts))
        verts = np.bincount(_distinct_pairs(np.repeat(face, 3), self.tri.reshape(-1)),
                            minlength=len(counts))  # fmt: skip
        edges = (3 * counts - per_face_h) // 2 + per_face_h
        holed = verts - edges + counts < 1
        mine = boundary[holed[face[tri_of[boundary]]]]
        mine = mine[np.argsort(face[tri_of[mine]], kind="stable")]  # grouped by face
        starts = np.flatnonzero(np.diff(face[tri_of[mine]], prepend=-1))
        rims = []
        for hs in np.split(mine, starts[1:]) if len(mine) else []:
            rims += self._face_rims(hs, normal[tri_of[hs]].mean(0))
        return rims

    def _face_rims(self, hs: np.ndarray, n: np.ndarray) -> list[np.ndarray]:
        """The rims among one face's boundary loops (half-edges `hs`, face normal `n`)."""
        after = {int(self.start[h]): int(h) for h in hs}
        if len(after) != len(hs):  # the face touches itself at a vertex: skip it
            return []
        loops, seen = [], set()
        for h0 in hs:
            if int(h0) in seen:
                continue
            loop, h = [], int(h0)
            while h not in seen:
                seen.add(h)
                loop.append(h)
                h = after.get(int(self.end[h]), -1)
                if h < 0:  # an open chain: not a face's boundary as expected
                    return []
            loops.append(np.array(loop))
        rims, outer = [], 0
        for loop in loops:
            p, q = self.v[self.start[loop]], self.v[self.end[loop]]
            area = 0.5 * float(np.cross(p, q).sum(0) @ n)
            if area > 0:
                outer += 1
                continue
            wall = self.tri[self.twin[loop] // 3]  # the triangles across the loop
            far = wall.sum(1) - self.start[loop] - self.end[loop]  # their third vertices
            if np.all((self.v[far] - p) @ n < 0):
                rims.append(loop)
        return rims if outer == 1 else []


def _distinct_pairs(group: np.ndarray, item: np.ndarray) -> np.ndarray:
    """The group of each distinct (group, item) pair (items are non-negative integers)."""
    span = int(item.max(initial=0)) + 1
    key = np.sort(group.astype(np.int64) * span + item)
    first = np.ones(len(key), bool)
    first[1:] = key[1:] != key[:-1]
    return key[first] // span


def _cycles(links: list[tuple[int, int]], nodes: set[int]) -> int:
    """The cycle rank (edges - nodes + components) of a multigraph."""
    parent = {p: p for p in nodes}

    def root(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in links:
        parent[root(a)] = root(b)
    return len(links) - len(nodes) + len({root(p) for p in nodes})
