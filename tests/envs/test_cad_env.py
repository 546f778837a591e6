"""The `cad` environment: a build_part call is answered with the part's measurements (or why no
part came out), and the episode's final script is scored by the cad domain."""

import shutil
import uuid

import pytest

from posttrain.envs import make_env
from posttrain.rewards import default_registry
from posttrain.rewards._cad_tasks import make_cad_task

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")


def _turn(content="", **calls):
    tool_calls = [{"id": uuid.uuid4().hex[:9], "type": "function",
                   "function": {"name": "build_part", "arguments": {"script": s}}}
                  for s in calls.values()]  # fmt: skip
    return {"role": "assistant", "content": content, "tool_calls": tool_calls}


def test_a_multi_turn_episode_sees_each_part_then_is_scored():
    task = make_cad_task(0, 1)  # a 35 x 15 x 5 plate with one 3 mm hole
    env = make_env("cad", task)
    messages = env.reset()
    assert messages[0]["role"] == "system" and "build_part" in messages[0]["content"]
    assert task["prompt"] in messages[-1]["content"]

    wrong = "import cad\ncad.show(cad.box(35, 15, 5))\n"
    step = env.step(_turn(a=wrong))
    assert not step.done and "35.00 x 15.00 x 5.00 mm" in step.observations[0]["content"]
    assert "0 through-hole(s)" in step.observations[0]["content"]
    step = env.step(_turn(a="import cad\ncad.show(cad.box(-1, 1, 1))\n"))
    assert "no part" in step.observations[0]["content"] and step.info["tool_errors"] == 1
    step = env.step(_turn(a=task["reference"]))
    assert "1 through-hole(s)" in step.observations[0]["content"]

    final = f"```python\n{task['reference']}```"
    step = env.step({"role": "assistant", "content": final})
    assert step.done and step.reward is None  # the record's cad domain scores the answer
    total, _ = default_registry().score(task, final)
    assert total == pytest.approx(1.0)


def test_with_render_dir_each_part_built_comes_with_its_render(tmp_path):
    from PIL import Image

    task = make_cad_task(0, 1)
    env = make_env("cad", task, render_dir=str(tmp_path / "renders"))
    env.reset()
    step = env.step(_turn(a=task["reference"], b="import cad\ncad.show(cad.box(-1, 1, 1))\n"))
    built, failed = step.observations
    assert "1 through-hole(s)" in built["content"] and len(built["images"]) == 1
    image = Image.open(built["images"][0])
    assert image.format == "PNG" and image.size == (512, 512)
    assert built["images"][0].startswith(str(tmp_path / "renders"))
    assert "images" not in failed  # no part, no render
    plain = make_env("cad", task)
    plain.reset()
    assert "images" not in plain.step(_turn(a=task["reference"])).observations[0]


def test_a_refused_part_and_crossing_bores_are_answered_in_words():
    """A part doubled 16 times is refused with its size before any geometry; two crossing
    bores are reported as 2 through-holes (the genus would say 3)."""
    env = make_env("cad", make_cad_task(0, 1))
    env.reset()
    doubled = ("import cad\ns = cad.box(1, 1, 1)\nfor i in range(16):\n"
               "    s = s + s.translate(2 * (i + 1), 0, 0)\ncad.show(s)\n")  # fmt: skip
    crossing = ("import cad\nbore = cad.cylinder(24, 3)\nb = cad.box(20, 20, 20)\n"
                "b = b - bore.rotate(0, 90, 0).translate(-2, 10, 10)\n"
                "cad.show(b - bore.rotate(-90, 0, 0).translate(10, -2, 10))\n")  # fmt: skip
    step = env.step(_turn(a=doubled, b=crossing))
    refused, built = step.observations
    assert "no part" in refused["content"] and "65,536 primitives" in refused["content"]
    assert "2 through-hole(s)" in built["content"] and step.info["tool_errors"] == 1
