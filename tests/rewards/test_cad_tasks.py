"""The CAD task generator: reproducible tasks whose reference scripts, run in the sandbox, build
exactly their targets (score 1) with the hole counts the text states."""

import re
import shutil

import pytest

from posttrain.rewards._cad import build, cad_reward
from posttrain.rewards._cad_geometry import measure
from posttrain.rewards._cad_tasks import FAMILIES, cad_sft_record, make_cad_task

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")


def test_tasks_are_reproducible_and_cover_every_family():
    assert make_cad_task(7, 2) == make_cad_task(7, 2)
    assert make_cad_task(7, 2) != make_cad_task(8, 2)
    families = {make_cad_task(seed, level)["family"] for level in FAMILIES for seed in range(12)}
    assert families == {"plate", "bracket", "flange", "gear", "enclosure"}


@pytest.mark.parametrize("level", sorted(FAMILIES))
def test_reference_scripts_build_their_targets_in_the_sandbox(level):
    for seed in range(3):
        task = make_cad_task(seed, level)
        target = measure(build(task["target"]))
        assert target.valid and target.bodies == 1 and target.holes == task["holes"], task
        total, info = cad_reward(task, cad_sft_record(task)["messages"][1]["content"])
        assert total == pytest.approx(1.0), (task["family"], info)
        assert info["missing"] == [] and info["components"]["features"] == 1.0


def test_reference_scripts_state_the_text_s_numbers_and_derive_the_rest():
    """A reference script writes only numbers the text states (and a few constants of the
    construction) and computes the rest (a radius, an inner wall, the bolt circle's radius): a
    model that learns from it copies numbers and never does the sums."""
    structural = {"0", "1", "2", "4", "90", "360", "96"}  # half, both sides, quarter-turns
    for level in sorted(FAMILIES):
        for seed in range(40):
            task = make_cad_task(seed, level)
            stated = re.findall(r"\d+(?:\.\d+)?", task["prompt"])
            written = re.findall(r"(?<![\w.])\d+(?:\.\d+)?", task["reference"])
            computed = [n for n in written if n not in stated and n not in structural]
            assert not computed, (task["family"], computed, task["reference"])
