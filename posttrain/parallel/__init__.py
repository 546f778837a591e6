"""Parallelism: the device mesh, logical-axis sharding rules and helpers to place data."""

from posttrain.parallel._distributed import (
    DistributedConfig,
    DistributedError,
    Watchdog,
    initialize,
)
from posttrain.parallel._exchange import (
    CHECK_ENV,
    ProcessesDiverged,
    agree,
    checks_enabled,
    crossing,
    exchange,
)
from posttrain.parallel._mesh import (
    MESH_AXES,
    MeshConfig,
    last_of_each_process,
    make_mesh,
    mesh_of,
    process_meshes,
)
from posttrain.parallel._rules import (
    DEFAULT_RULES,
    LogicalAxes,
    Rules,
    axis_rules,
    constrain,
    current_rules,
    logical_to_spec,
    named_sharding,
    tree_shardings,
)
from posttrain.parallel._shard import fetch, process_rows, put, shard_batch, to_process_local

__all__ = [
    "CHECK_ENV",
    "ProcessesDiverged",
    "agree",
    "checks_enabled",
    "crossing",
    "exchange",
    "DEFAULT_RULES",
    "DistributedConfig",
    "DistributedError",
    "Watchdog",
    "initialize",
    "MESH_AXES",
    "LogicalAxes",
    "MeshConfig",
    "Rules",
    "axis_rules",
    "constrain",
    "current_rules",
    "logical_to_spec",
    "last_of_each_process",
    "fetch",
    "make_mesh",
    "mesh_of",
    "named_sharding",
    "process_meshes",
    "process_rows",
    "put",
    "shard_batch",
    "to_process_local",
    "tree_shardings",
]
