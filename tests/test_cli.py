"""The `posttrain` entry point."""

import subprocess
import sys

import pytest

from posttrain import cli


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in cli._COMMANDS:
        assert f"  {command}" in out


def test_unknown_commands_name_the_nearest_one(capsys):
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'; did you mean 'train'?" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(cli._COMMANDS))
def test_every_command_has_help_with_an_example(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert out.startswith(f"usage: posttrain {command} [flags]")
    examples = out.split("examples:")[1].split("flags:")[0]
    assert f"posttrain {command} --" in examples
    assert "--" in out.split("flags:")[1]  # the command's own flags, each with its help


def test_wrong_flags_and_keys_name_the_nearest_valid_one(tmp_path):
    with pytest.raises(
        SystemExit, match="Unknown command line flag 'workdr'. Did you mean: workdir"
    ):
        cli.main(["train", "--config=configs/sft.py:tiny", "--workdr=x"])
    with pytest.raises(SystemExit, match="did you mean --config.optimizer.learning_rate"):
        cli.main(
            [
                "train",
                "--config=configs/sft.py:tiny",
                f"--workdir={tmp_path}",
                "--config.optimizer.learnin_rate=0.1",
            ]
        )


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
