"""The `posttrain` entry point."""

import subprocess
import sys

import pytest

from posttrain import cli
from posttrain.cli import data


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in cli._COMMANDS:
        assert f"  {command}" in out


def test_unknown_commands_name_the_nearest_one(capsys):
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'; did you mean 'train'?" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command", sorted({*cli._COMMANDS, *(f"data {v}" for v in data.VERBS)} - {"data"})
)
def test_every_command_has_help_with_an_example(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([*command.split(), "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert out.startswith(f"usage: posttrain {command} [flags]")
    examples = out.split("examples:")[1].split("flags:")[0]
    assert f"posttrain {command} " in examples
    assert "--" in out.split("flags:")[1]  # the command's own flags, each with its help


def test_data_lists_its_verbs_and_names_the_nearest_one(capsys):
    assert cli.main(["data", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {verb} " in out for verb in data.VERBS)
    assert cli.main(["data", "stratfy"]) == 2
    assert "unknown data verb 'stratfy'; did you mean 'stratify'?" in capsys.readouterr().err


def _refused(argv, capsys) -> str:
    """The message of a command the CLI refuses as a user error (exit code 2, no traceback)."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_wrong_flags_and_keys_name_the_nearest_valid_one(tmp_path, capsys):
    err = _refused(["train", "--config=configs/sft.py:tiny", "--workdr=x"], capsys)
    assert "Unknown command line flag 'workdr'. Did you mean: workdir" in err
    lr = "--config.optimizer.learnin_rate=0.1"
    err = _refused(["train", "--config=configs/sft.py:tiny", f"--workdir={tmp_path}", lr], capsys)
    assert "did you mean --config.optimizer.learning_rate" in err


def test_train_without_flags_says_what_is_needed(capsys):
    err = _refused(["train"], capsys)
    assert "--config=configs/<method>.py[:preset] and --workdir=DIR are required" in err
    assert "Unknown command line flag 'bogus'" in _refused(["train", "--bogus=1"], capsys)


def test_config_override_of_an_unknown_key_is_refused(tmp_path, capsys):
    key = "--config.train.nonexistent=3"
    err = _refused(["train", "--config=configs/sft.py:tiny", f"--workdir={tmp_path}", key], capsys)
    assert "nonexistent" in err


def test_module_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "posttrain", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "usage: posttrain" in result.stdout


def test_exit_codes_tell_a_scheduler_what_happened(monkeypatch, tmp_path, capsys):
    """0 finished, 75 preempted and saved (requeue it), 4 diverged, 1 a bug (traceback)."""
    from posttrain import errors, methods
    from posttrain.train import TrainingDiverged

    argv = ["train", "--config=configs/sft.py:tiny", f"--workdir={tmp_path}"]
    outcomes = {
        "completed": lambda c, w: {"stopped": "completed", "final_step": 9},
        "preempted": lambda c, w: {"stopped": "preempted", "final_step": 4},
    }
    for stopped, run in outcomes.items():
        monkeypatch.setattr(methods, "run_from_config", run)
        code = {"completed": errors.EXIT_OK, "preempted": errors.EXIT_PREEMPTED}[stopped]
        assert cli.main(argv) == code
    assert "rerun to resume" in capsys.readouterr().out

    def diverged(c, w):
        raise TrainingDiverged("5 consecutive steps had a non-finite loss")

    monkeypatch.setattr(methods, "run_from_config", diverged)
    assert cli.main(argv) == errors.EXIT_DIVERGED == 4
    assert "non-finite loss" in capsys.readouterr().err

    def bug(c, w):
        return {}["a key the code forgot"]

    monkeypatch.setattr(methods, "run_from_config", bug)
    assert cli.main(argv) == errors.EXIT_BUG
    assert "Traceback" in capsys.readouterr().err  # a bug keeps its traceback


def test_list_fields_are_set_from_the_command_line(capsys):
    """docs/configs.md: any field can be set, a list as a JSON or Python literal."""
    from posttrain.cli._flags import config_flag, parse

    source = {"path": "a.jsonl", "weight": 2.0, "domain": "math", "format": "auto"}
    argv = ["posttrain train", "--config=configs/grpo.py:tiny", "--config.eval_data=[]",
            f"--config.data.sources=[{source}]",  # Python (single quotes)
            '--config.lora.targets=["attn/q$", "mlp/up$"]']  # JSON  # fmt: skip
    fv = parse(argv, lambda flags, fv: config_flag(fv, argv))
    assert fv.config.eval_data == []
    assert [dict(s) for s in fv.config.data.sources] == [source]
    assert list(fv.config.lora.targets) == ["attn/q$", "mlp/up$"]
    err = _refused(["train", "--config=configs/sft.py:tiny", "--workdir=w",
                    "--config.eval_data={'path': 'a.jsonl'}"], capsys)  # fmt: skip
    assert "is not a list: write a JSON or Python list" in err


def test_a_resumed_run_says_so(tmp_path, capsys):
    """The second run of a workdir names the checkpoint it resumes from (its metrics.jsonl is cut
    back to that step), in the shell's stderr."""
    argv = ["train", "--config=configs/sft.py:tiny", f"--workdir={tmp_path}",
            "--config.model.checkpoint=", "--config.eval_data=[]", "--config.train.progress=false",
            "--config.checkpoint.async_save=false", "--config.data.batch_size=8"]  # fmt: skip
    assert cli.main([*argv, "--config.train.steps=1"]) == 0
    assert "resumed" not in capsys.readouterr().err
    assert cli.main([*argv, "--config.train.steps=2"]) == 0
    err = capsys.readouterr().err
    assert f"posttrain: resumed from step 1 ({tmp_path}/checkpoints/1)" in err, err
