"""The `cad` environment: the model builds parts with a `build_part` tool and sees what each
script built, as text measurements (and, optionally, as a rendered image), before it answers
with its final script.

Each `build_part(script)` runs the script in the sandbox and builds and measures its part under
the same time and memory limits (`posttrain.rewards._cad`), and answers with the part's
bounding-box extents, volume, bodies, through-holes and whether it stands stably, or with why
no part came out (the script's error, a cap or limit it hit). With `render_dir` set,
each part built is also drawn in four orthographic views (`_cad_render.render_views`) to
`<render_dir>/<episode>_<call>.png`, and its tool message lists the PNG under `"images"` beside
the text `content`: a multimodal model's chat template can show it, a text template ignores
it. The episode ends at the first turn without a tool call; its text (the final script in a
```python block) is scored by the record's `cad` reward domain against the target.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from typing import Any

from posttrain import paths
from posttrain.envs._base import Step, Tool, ToolEnvironment, register_env
from posttrain.rewards import Measurements, render_views, run_script

CAD_SYSTEM = (
    "You design parts with CAD scripts (import cad: box, cylinder, cone, sphere, extrude, "
    "revolve, translate, rotate, scale, mirror, + union, - difference, & intersection; end "
    "with cad.show(part)). Call build_part with a script to see what it builds. When the part "
    "matches the request, answer with the final script in a ```python block and no tool call."
)


def describe(m: Measurements) -> str:
    """What a built part measures (`_cad_geometry.measure`), in words a model reads."""
    if not m.valid:
        return "The script ran but produced an empty or invalid part."
    x, y, z = m.extents
    return (
        f"Built a part: bounding box {x:.2f} x {y:.2f} x {z:.2f} mm, volume {m.volume:.1f} "
        f"mm^3, {m.bodies} separate bod{'y' if m.bodies == 1 else 'ies'}, {m.holes} "
        f"through-hole(s), {'stands stably' if m.stable else 'tips over'} on its base."
    )


class CADEnvironment(ToolEnvironment):
    """A `cad` episode: the `build_part` tool, and with `render_dir` a render of each part built,
    listed under `"images"` in the tool message that answers its call."""

    def __init__(self, record: Mapping[str, Any], *, timeout_s: float, memory_mb: int,
                 system: str, render_dir: str):  # fmt: skip
        def build_part(script: str) -> str:
            """Runs a CAD script and reports the part it builds (or why it built none).

            Args:
                script: Python using `import cad`, ending with cad.show(part).
            """
            return self._build(script)

        super().__init__(record, [Tool(build_part)], system=system)
        if paths.is_remote(render_dir):
            raise ValueError(f"cad env: render_dir must be a local folder, got {render_dir!r}")
        self.timeout_s, self.memory_mb, self.render_dir = timeout_s, memory_mb, render_dir
        self.episode = secrets.token_hex(4)  # names this episode's renders
        self.calls = 0  # build_part calls so far (numbers the renders)
        self._rendered: list[str] = []  # the current call's renders
        self._images: list[list[str]] = []  # per call of the current turn, its renders

    def _build(self, script: str) -> str:
        self.calls += 1
        result = run_script(script, timeout_s=self.timeout_s, memory_mb=self.memory_mb)
        if result.solid is None:
            raise RuntimeError(f"no part: {result.error}")
        text = describe(result.measurements)
        if self.render_dir:
            path = os.path.join(self.render_dir, f"{self.episode}_{self.calls}.png")
            box = result.solid.bounding_box()  # (min x, y, z, max x, y, z)
            title = "part: " + " x ".join(f"{box[i + 3] - box[i]:.2f}" for i in range(3)) + " mm"
            self._rendered.append(render_views(result.solid, path, title=title))
        return text

    def call(self, call: Mapping[str, Any]) -> tuple[str, bool]:
        self._rendered = []
        content, ok = super().call(call)
        self._images.append(self._rendered)
        return content, ok

    def step(self, message: dict) -> Step:
        self._images = []
        step = super().step(message)
        # The calls' answers close the observations, in call order (parse errors come first).
        answers = step.observations[len(step.observations) - len(self._images) :]
        for observation, images in zip(answers, self._images, strict=True):
            if images:
                observation["images"] = images
        return step


def cad_env(
    record: Mapping[str, Any],
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 256,
    system: str = CAD_SYSTEM,
    render_dir: str = "",
) -> ToolEnvironment:
    """An episode of a `cad` task with the `build_part` tool.

    Args:
      record: the task's prompt record (`make_cad_task`).
      timeout_s: per script, in the sandbox.
      memory_mb: per script, in the sandbox.
      system: the system message put before the prompt.
      render_dir: a local folder; if set, each part built is rendered there (four views, a PNG
        per call) and its tool message lists the PNG's path under "images".
    """
    return CADEnvironment(record, timeout_s=timeout_s, memory_mb=memory_mb, system=system,
                          render_dir=render_dir)  # fmt: skip


register_env("cad", cad_env)
