"""The `posttrain` entry point."""

import subprocess
import sys

from posttrain import cli


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("train", "generate", "eval", "export", "compile", "sweep", "demo"):
        assert f"  {command}" in out


def test_unknown_and_pending_commands_fail_clearly(capsys):
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err
    assert cli.main(["train"]) == 2
    assert "issue #3" in capsys.readouterr().err


def test_module_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "posttrain", "demo"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "SFT" in result.stdout
