"""The `cad` environment: the model builds parts with a `build_part` tool and sees what each
script built, as text measurements, before it answers with its final script.

Each `build_part(script)` runs the script in the sandbox (`posttrain.rewards._cad`) and answers
with the part's bounding-box extents, volume, bodies, through-holes and whether it stands
stably, or with why no part came out (the script's error, a cap it hit). The episode ends at the
first turn without a tool call; its text (the final script in a ```python block) is scored by
the record's `cad` reward domain against the target. Renders of each part are still to come
(the text measurements are what a text-only model can read).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttrain.envs._base import Tool, ToolEnvironment, register_env
from posttrain.rewards._cad import run_script
from posttrain.rewards._cad_geometry import measure

CAD_SYSTEM = (
    "You design parts with CAD scripts (import cad: box, cylinder, cone, sphere, extrude, "
    "revolve, translate, rotate, scale, mirror, + union, - difference, & intersection; end "
    "with cad.show(part)). Call build_part with a script to see what it builds. When the part "
    "matches the request, answer with the final script in a ```python block and no tool call."
)


def describe(solid) -> str:
    """What a built part measures, in words a model reads."""
    m = measure(solid)
    if not m.valid:
        return "The script ran but produced an empty or invalid part."
    x, y, z = m.extents
    return (
        f"Built a part: bounding box {x:.2f} x {y:.2f} x {z:.2f} mm, volume {m.volume:.1f} "
        f"mm^3, {m.bodies} separate bod{'y' if m.bodies == 1 else 'ies'}, {m.holes} "
        f"through-hole(s), {'stands stably' if m.stable else 'tips over'} on its base."
    )


def cad_env(
    record: Mapping[str, Any],
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 256,
    system: str = CAD_SYSTEM,
) -> ToolEnvironment:
    """An episode of a `cad` task with the `build_part` tool."""

    def build_part(script: str) -> str:
        """Runs a CAD script and reports the part it builds (or why it built none).

        Args:
            script: Python using `import cad`, ending with cad.show(part).
        """
        result = run_script(script, timeout_s=timeout_s, memory_mb=memory_mb)
        if result.solid is None:
            raise RuntimeError(f"no part: {result.error}")
        return describe(result.solid)

    return ToolEnvironment(record, [Tool(build_part)], system=system)


register_env("cad", cad_env)
