"""Device mesh from config: six named axes, sizes inside a slice (ici) and across slices (dcn)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

# Outermost first: data parallelism crosses the slowest links, tensor parallelism the fastest;
# pipeline stages pass only activations between neighbours, so they too can cross slices.
MESH_AXES = ("data", "stage", "fsdp", "expert", "sequence", "tensor")
_BEFORE_STAGE = ("data", "fsdp", "expert", "sequence", "tensor")  # saved configs before "stage"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape. Each axis size is an int; -1 (at most once per level) takes what is left."""

    # Sizes inside one slice (ICI links), per axis of MESH_AXES.
    ici: tuple[int, ...] = (1, 1, -1, 1, 1, 1)
    # Sizes across slices (DCN links); their product is the number of slices.
    dcn: tuple[int, ...] = (1, 1, 1, 1, 1, 1)
    # Logical-axis rules added to (and overriding) DEFAULT_RULES: ((name, mesh axes), ...).
    rules: tuple = ()

    @classmethod
    def from_config(cls, values: Mapping, where: str = "mesh") -> MeshConfig:
        """From a config section `{"ici": {...}, "dcn": {...}, "rules": [...]}`."""
        unknown = sorted(set(values) - {"ici", "dcn", "rules"})
        if unknown:
            raise ValueError(
                f"{where} has unknown key(s) {unknown}; known: ['dcn', 'ici', 'rules']"
            )
        rules = tuple(
            (name, tuple(axes) if isinstance(axes, list | tuple) else axes)
            for name, axes in values.get("rules") or ()
        )
        levels = {}
        for level in ("ici", "dcn"):
            sizes = values.get(level)
            if isinstance(sizes, list | tuple):  # the saved form: one size per axis
                axes = _BEFORE_STAGE if len(sizes) == len(_BEFORE_STAGE) else MESH_AXES
                if len(sizes) != len(axes):
                    raise ValueError(f"{where}.{level} needs {len(MESH_AXES)} sizes {MESH_AXES}")
                sizes = dict(zip(axes, sizes, strict=True))
            levels[level] = sizes
        base = cls.from_dict(levels["ici"], levels["dcn"])
        return dataclasses.replace(base, rules=rules)

    @property
    def axis_rules(self):
        """DEFAULT_RULES with this config's rules taking precedence."""
        from posttrain.parallel._rules import DEFAULT_RULES

        return tuple(DEFAULT_RULES) + tuple(self.rules)

    @classmethod
    def from_dict(
        cls, ici: Mapping[str, int] | None = None, dcn: Mapping[str, int] | None = None
    ) -> MeshConfig:
        """Builds a config from `{"fsdp": -1, "tensor": 4}`-style dicts; absent axes are 1."""
        return cls(ici=_axis_tuple(ici or {"fsdp": -1}, "ici"), dcn=_axis_tuple(dcn or {}, "dcn"))


def _axis_tuple(sizes: Mapping[str, int], level: str) -> tuple[int, ...]:
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
        raise ValueError(
            f"mesh.{level} names unknown axes {sorted(unknown)}; the mesh axes are {MESH_AXES}"
        )
    return tuple(int(sizes.get(axis, 1)) for axis in MESH_AXES)


def _resolve(sizes: Sequence[int], total: int, level: str) -> tuple[int, ...]:
    unit = "slice(s)" if level == "dcn" else "devices per slice"
    """Fills a single -1 so the product equals `total`; errors name the axes and the count."""
    desc = ", ".join(f"{a}={s}" for a, s in zip(MESH_AXES, sizes, strict=True) if s != 1)
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh.{level} sizes must be positive or -1, got {desc}")
    if list(sizes).count(-1) > 1:
        raise ValueError(f"mesh.{level} may use -1 for one axis only, got {desc}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if total % known:
            raise ValueError(
                f"mesh.{level} ({desc}) cannot fill -1: {known} does not divide {total} {unit}"
            )
        sizes = [total // known if s == -1 else s for s in sizes]
    elif known != total:
        raise ValueError(
            f"mesh.{level} ({desc or 'all 1'}) multiplies to {known}, but there are "
            f"{total} {unit}; make the sizes multiply to {total} "
            f"or set one axis to -1"
        )
    return tuple(sizes)


def make_mesh(
    config: MeshConfig = MeshConfig(), devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """Lays the devices out on the six named axes.

    Args:
      config: axis sizes inside (ici) and across (dcn) slices.
      devices: defaults to all of `jax.devices()`.

    Returns:
      A `Mesh` with axes `MESH_AXES`, topology-aware on TPU (hybrid across slices).
    """
    devices = list(jax.devices() if devices is None else devices)
    num_slices = len({getattr(d, "slice_index", 0) for d in devices})
    dcn = _resolve(config.dcn, num_slices, "dcn")
    ici = _resolve(config.ici, len(devices) // num_slices, "ici")
    if num_slices > 1:
        device_array = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
    else:
        try:
            device_array = mesh_utils.create_device_mesh(ici, devices)
        except (AssertionError, NotImplementedError, ValueError):
            # Partial TPU slices or odd shapes: fall back to the plain device order.
            device_array = np.asarray(devices).reshape(ici)
    return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_of(tree) -> Mesh:
    """The mesh the arrays of `tree` live on: their `NamedSharding`'s, or a mesh of the one
    device that holds them (a reward model or judge on the default device). `jax.set_mesh`
    it around a computation that must run where its arrays are, whatever mesh is current."""
    sharding = jax.tree.leaves(tree)[0].sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        return sharding.mesh
    return make_mesh(devices=sorted(sharding.device_set, key=lambda d: d.id))


def last_of_each_process(devices: Sequence[jax.Device], n: int) -> list[jax.Device]:
    """The last `n` of each process's `devices` (in process order): the devices a decoupled
    sampler or a distillation teacher takes from every process. Raises ValueError when a
    process has no more than `n` (none would be left to train on)."""
    processes = sorted({d.process_index for d in devices})
    out = []
    for p in processes:
        mine = [d for d in devices if d.process_index == p]
        if n >= len(mine):
            raise ValueError(
                f"{n} of the {len(mine)} devices of each process leaves no device to train on"
            )
        out += mine[-n:]
    return out


def process_meshes(
    devices: Sequence[jax.Device] | None = None, config: MeshConfig = MeshConfig()
) -> tuple[Mesh, Mesh]:
    """(this process's mesh of its own `devices` (default: all), every process's such mesh
    stacked on a leading "processes" axis): a sharding on the stacked mesh whose spec leaves
    "processes" out keeps a whole copy on each process's devices, laid out as on its own mesh."""
    devices = list(jax.devices() if devices is None else devices)
    per_process = [
        make_mesh(config, [d for d in devices if d.process_index == p])
        for p in range(jax.process_count())
    ]
    stacked = Mesh(
        np.stack([m.devices for m in per_process]),
        ("processes", *MESH_AXES),
        axis_types=(AxisType.Auto,) * (1 + len(MESH_AXES)),
    )
    return per_process[jax.process_index()], stacked
