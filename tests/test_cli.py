"""The `posttrain` entry point."""

import subprocess
import sys

import pytest

from posttrain import cli


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("train", "generate", "eval", "export", "compile", "sweep", "demo"):
        assert f"  {command}" in out


def test_unknown_and_pending_commands_fail_clearly(capsys):
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err
    assert cli.main(["sweep"]) == 2
    assert "issue #10" in capsys.readouterr().err


def test_train_without_flags_says_what_is_needed():
    with pytest.raises(
        SystemExit, match="--config=configs/<method>.py\\[:preset\\] and --workdir=DIR are required"
    ):
        cli.main(["train"])
    with pytest.raises(SystemExit, match="Unknown command line flag 'bogus'"):
        cli.main(["train", "--bogus=1"])


def test_config_override_of_an_unknown_key_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="nonexistent"):
        cli.main(
            [
                "train",
                "--config=configs/sft.py:tiny",
                f"--workdir={tmp_path}",
                "--config.train.nonexistent=3",
            ]
        )


def test_module_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "posttrain", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "usage: posttrain" in result.stdout
