"""Docs that are generated or checked: the config reference, and the shell scripts."""

import os
import shutil
import subprocess

import pytest

from posttrain import config_docs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_config_reference_is_up_to_date():
    with open(os.path.join(REPO, "docs", "configs.md")) as f:
        committed = f.read()
    assert committed == config_docs.render(), (
        "docs/configs.md is stale: run `python -m posttrain.config_docs`"
    )
    for field in ("optimizer.learning_rate", "rollout.num_generations", "loss.beta"):
        assert f"| `{field}` |" in committed


def test_every_config_field_has_a_comment():
    rows = [r for r in config_docs.render().splitlines() if r.startswith("| `")]
    missing = [r.split("|")[1].strip() for r in rows if r.rstrip().endswith("| |")]
    assert not missing, f"config fields without a comment in their file: {missing}"


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shell_scripts_pass_shellcheck():
    scripts = subprocess.run(
        ["git", "ls-files", "*.sh", ".ci/run"], cwd=REPO, capture_output=True, text=True
    ).stdout.split()
    assert scripts
    result = subprocess.run(["shellcheck", *scripts], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
