"""CAD scripts: run a model's script in the code sandbox, build and measure the solid it
describes under hard limits.

The script (written against `posttrain/rewards/_cad_api.py`, copied into the sandbox as
`cad.py`) runs with the standard library only and prints a construction tree. The host checks
the tree against the caps of `_cad_kernel` (no geometry: operations counted as if every part
were written out, facets, profile points, sizes, finite numbers) and has it built and measured
by the kernel in a child process under the same time and memory limits as the script
(`_cad_builder`): the script and its part share `timeout_s`, and each gets `memory_mb`. A
script can exhaust neither the sandbox, nor the kernel, nor the host: every refusal says which
limit or cap stopped it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping

from posttrain.rewards import sandbox
from posttrain.rewards._cad_api import MARKER
from posttrain.rewards._cad_builder import build_limited
from posttrain.rewards._cad_geometry import (
    DEFAULT_WEIGHTS,
    CADTask,
    Feature,
    Measurements,
    features_present,
    measure,
    score_measured,
)
from posttrain.rewards._cad_kernel import (
    MAX_NODES,
    MAX_POINTS,
    MAX_SEGMENTS,
    MAX_SIZE,
    CADError,
    build,
)
from posttrain.rewards._code import extract_code

__all__ = ["MAX_NODES", "MAX_POINTS", "MAX_SEGMENTS", "MAX_SIZE", "CADError", "ScriptResult",
           "build", "cad_reward", "cad_task", "completion_part", "run_script"]  # fmt: skip
API_SOURCE = open(os.path.join(os.path.dirname(__file__), "_cad_api.py")).read()


@dataclasses.dataclass(frozen=True)
class ScriptResult:
    """What a CAD script produced: the solid (None on failure) and why it failed."""

    solid: object | None  # manifold3d.Manifold
    error: str  # "" when the solid was built
    stdout: str  # what the script printed besides the result (kept for feedback)
    measurements: Measurements | None = None  # the solid's, measured under the limits
    iou: float | None = None  # with `run_script`'s target, when one was given


def run_script(
    code: str, *, timeout_s: float = 10.0, memory_mb: int = 256, target: dict | None = None
) -> ScriptResult:
    """Runs a CAD script in the sandbox, then builds and measures its part under the same limits.

    Args:
      code: the script.
      timeout_s: wall-clock seconds for the script and its part together.
      memory_mb: the script's memory in the sandbox, and the memory building its part may add.
      target: a trusted construction tree; the result's `iou` is the part's IoU with it.
    """
    start = time.monotonic()
    result = sandbox.run(
        code, timeout_s=timeout_s, memory_mb=memory_mb, files={"cad.py": API_SOURCE}
    )
    lines = result.stdout.splitlines()
    shown = [line for line in lines if line.startswith(MARKER)]
    printed = "\n".join(line for line in lines if not line.startswith(MARKER))
    if result.timed_out:
        return ScriptResult(None, f"the script timed out after {timeout_s:g} s", printed)
    if result.exit_code != 0:
        tail = result.stderr.strip().splitlines()[-1:] or [f"exit code {result.exit_code}"]
        return ScriptResult(None, f"the script failed: {tail[0]}", printed)
    if len(shown) != 1:
        return ScriptResult(None, f"the script called cad.show {len(shown)} times (once)", printed)
    try:
        tree = json.loads(shown[0][len(MARKER) :])
    except json.JSONDecodeError:
        return ScriptResult(None, "the part's description is cut off (too large)", printed)
    left = timeout_s - (time.monotonic() - start)
    built = build_limited(tree, timeout_s=max(left, 0.001), memory_mb=memory_mb, target=target)
    if built.timed_out:
        error = f"the script and building its part took longer than {timeout_s:g} s"
        return ScriptResult(None, error, printed)
    return ScriptResult(built.solid, built.error, printed, built.measurements, built.iou)


def completion_part(completion: str, **limits) -> ScriptResult:
    """Runs a completion's script (its last ```python block, else the whole text) and builds
    its part (`run_script`; `limits`: timeout_s, memory_mb)."""
    return run_script(extract_code(completion) or completion, **limits)


def cad_task(record: Mapping) -> CADTask:
    """What a `cad` record scores a part against besides its target (see `cad_reward`)."""
    return CADTask(
        holes=record.get("holes"),
        tolerance=float(record.get("tolerance", CADTask.tolerance)),
        weights=tuple(dict(record.get("weights") or DEFAULT_WEIGHTS).items()),
        features=tuple(Feature(**f) for f in record.get("features") or ()),
        aggregate=record.get("aggregate", "mean"),
        cap=float(record.get("cap", CADTask.cap)),
    )


def cad_reward(
    record: Mapping, completion: str, *, timeout_s: float = 10.0, memory_mb: int = 256
) -> tuple[float, dict]:
    """The `cad` domain: the completion's script (its last ```python block, else the whole
    text) is run, its part built and measured under the limits, and scored against the
    record's target (`_cad_geometry.score_measured`).

    Args:
      record: `target`, the target part's construction tree (what `cad.show` prints, parsed);
        optional `holes` (through-holes the part must have), `tolerance` (relative, on the
        bounding box's extents), `weights` ({component: weight}), `features` (required
        features: [{name, kind, probe}], `_cad_geometry.Feature`), `aggregate` ("mean", the
        default, or "gated": a missing required feature caps the total at `cap`).
      completion: the generated text.

    Returns:
      (total, info): info["components"] holds every component (`valid`, `iou`,
      `dimensions`, `holes`, `single_body`, `stable`, and `features` when the record lists
      some; RL logs each one's mean), info["error"] why the script produced no part ("" if it
      did) and info["missing"] the required features the part lacks.
    """
    task = cad_task(record)
    code = extract_code(completion) or completion
    result = run_script(code, timeout_s=timeout_s, memory_mb=memory_mb, target=record["target"])
    present = {}
    if result.measurements is None:
        parts = {**dict.fromkeys(dict(task.weights), 0.0), "total": 0.0}
        parts |= {"features": 0.0} if task.features else {}
    else:  # (the record's target and probes are trusted: built and measured here)
        want = measure(build(record["target"]))
        if result.measurements.valid:
            present = features_present(result.solid, task.features)
        parts = score_measured(result.measurements, want, result.iou or 0.0, task, present)
    total = parts.pop("total")
    missing = [f.name for f in task.features if not present.get(f.name, False)]
    return total, {"components": parts, "error": result.error, "missing": missing}
