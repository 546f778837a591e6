"""Bad input through the CLI, as a new user would type it: each case exits with the documented
code (posttrain/errors.py; 2 for a user error), prints one message naming the offending key,
flag or file and no traceback, and leaves the workdir it was given as it was.

The commands run in this process (`posttrain.cli.main`, what `python -m posttrain` calls); one
case runs as a real subprocess for the exit status and stderr the shell sees. Every case fails
before anything compiles, so the table costs seconds.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import pytest

from posttrain import cli
from posttrain.demo import ASSETS_DIR
from posttrain.models import Transformer, get_preset, init_params, to_hf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT = f"--config={REPO}/configs/sft.py:tiny"
GRPO = f"--config={REPO}/configs/grpo.py:tiny"
DPO = f"--config={REPO}/configs/dpo.py:tiny"
EVAL = f"--config={REPO}/configs/eval.py:demo"

# A config file whose preset names which data problem to build (paths under $BAD_INPUTS).
_DATA_CONFIG = """
import os
from posttrain.config import load_config_file

def get_config(case):
    c = load_config_file({sft!r})
    c.eval_data = []
    c.mesh.ici = {{"data": -1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1}}
    source = c.data.sources[0]
    source.path = os.path.join(os.environ["BAD_INPUTS"], case + ".jsonl")
    if case == "unknown_format":
        source.format = "parquet-ish"
    return c
"""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Bad files and a workdir of a finished run (a "tiny" model with other widths)."""
    root = tmp_path_factory.mktemp("bad_inputs")
    (root / "malformed.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}\n')
    (root / "no_text.jsonl").write_text('{"id": 1}\n{"id": 2}\n')
    (root / "unknown_format.jsonl").write_text((ASSETS_DIR / "train.jsonl").read_text()[:2000])
    (root / "data.py").write_text(_DATA_CONFIG.format(sft=f"{REPO}/configs/sft.py:tiny"))
    (root / "not_a_model").mkdir()
    (root / "not_a_model" / "notes.txt").write_text("not weights")
    (root / "broken_hf").mkdir()
    (root / "broken_hf" / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    (root / "prompts.jsonl").write_text('"What is 1 + 1?"\n{"question": 2}\n')
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    for name in ("records", "ev", "hard"):  # data tools' inputs (and an existing output)
        (root / f"{name}.jsonl").write_text(json.dumps(chat) + "\n")
    os.symlink(root / "records.jsonl", root / "link.jsonl")
    os.link(root / "records.jsonl", root / "hardlink.jsonl")
    (root / "asked.jsonl").write_text('"What is 2 + 2?"\n')
    (root / "asked.completions.jsonl").write_text('{"completion": "4"}\n')  # a run before
    (root / "cad").mkdir()
    (root / "cad" / "train.jsonl").write_text("{}\n")  # a `data cad` run before
    damaged = root / "damaged_hf"  # a model directory whose weights file was cut short
    tiny = get_preset("tiny")
    to_hf(Transformer(init_params(tiny, jax.random.key(0)), tiny), str(damaged))
    shutil.copytree(ASSETS_DIR / "tokenizer", damaged, dirs_exist_ok=True)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])

    run = root / "run"  # what a finished run leaves, with a model of other widths
    model = dataclasses.replace(get_preset("tiny"), embed_dim=96)
    saved = run / "checkpoints" / "4" / "model_config"
    saved.mkdir(parents=True)
    (saved / "metadata").write_text(json.dumps(dataclasses.asdict(model), default=str))
    (run / "config.json").write_text('{"method": "sft"}')
    (run / "metrics.jsonl").write_text('{"step": 4, "split": "train", "loss": 1.5}\n')
    os.environ["BAD_INPUTS"] = str(root)
    return root


def _tree(path) -> dict[str, bytes]:
    """Every file under `path` (relative name -> contents)."""
    out = {}
    for dirpath, _, files in os.walk(path):
        for f in files:
            full = os.path.join(dirpath, f)
            out[os.path.relpath(full, path)] = open(full, "rb").read()
    return out


# (id, argv with {root} for the inputs folder and {run} for the finished run, what stderr names)
CASES = [
    # flags and config files
    ("no-flags", ["train"], "--workdir=DIR are required"),
    ("unknown-flag", ["train", SFT, "--workdir={run}", "--wrkdir=x"], "Did you mean: workdir"),
    (
        "missing-config-file",
        ["train", "--config=configs/nope.py", "--workdir={run}"],
        "configs/nope.py: no such config file",
    ),
    (
        "unknown-preset",
        ["train", f"--config={REPO}/configs/sft.py:huge", "--workdir={run}"],
        "sft.py:huge",
    ),
    (
        "unknown-key",
        ["train", SFT, "--workdir={run}", "--config.train.stepz=3"],
        "did you mean --config.train.steps",
    ),
    (
        "retired-key",  # the static sampler is gone: the message says what replaces it
        ["train", GRPO, "--workdir={run}", "--config.rollout.sampler=static"],
        "no key 'rollout.sampler' any more: every rollout decodes on the engine",
    ),
    (
        "not-a-number",
        ["train", SFT, "--workdir={run}", "--config.optimizer.learning_rate=fast"],
        "--config.optimizer.learning_rate=fast",
    ),
    (
        "no-model",  # a config for a real model whose model.hf_path is left unset: no random init
        [
            "train",
            f"--config={REPO}/configs/agent.py:terminal_qwen25_7b",
            "--workdir={run}",
            f"--config.tokenizer={ASSETS_DIR}/tokenizer",
        ],
        "no model to start from: set model.hf_path",
    ),  # fmt: skip
    (
        "nan-learning-rate",
        ["train", SFT, "--workdir={run}", "--config.optimizer.learning_rate=nan"],
        "config.optimizer.learning_rate: nan is not a finite number",
    ),
    (
        "inf-beta",
        ["train", DPO, "--workdir={run}", "--config.loss.beta=inf"],
        "config.loss.beta: inf is not a finite number",
    ),
    (
        "negative-learning-rate",
        ["train", SFT, "--workdir={run}", "--config.optimizer.learning_rate=-0.1"],
        "optimizer.learning_rate must be > 0",
    ),
    (
        "adam-beta",
        ["train", SFT, "--workdir={run}", "--config.optimizer.b2=1.5"],
        "optimizer.b1 and optimizer.b2 must be in [0, 1)",
    ),
    (
        "schedule",
        ["train", SFT, "--workdir={run}", "--config.optimizer.schedule=cosin"],
        "optimizer.schedule='cosin'",
    ),
    ("zero-steps", ["train", SFT, "--workdir={run}", "--config.train.steps=0"], "train.steps"),
    (
        "keep-last",
        ["train", SFT, "--workdir={run}", "--config.checkpoint.keep_last=-1"],
        "checkpoint.keep_last",
    ),
    (
        "save-every",
        ["train", SFT, "--workdir={run}", "--config.checkpoint.every=0"],
        "checkpoint.every=0",
    ),
    (
        "max-bad-steps",
        ["train", SFT, "--workdir={run}", "--config.train.max_bad_steps=0"],
        "train.max_bad_steps >= 1",
    ),
    (
        "micro-batches",
        ["train", SFT, "--workdir={run}", "--config.train.micro_batches=3"],
        "not divisible by train.micro_batches=3",
    ),
    ("mesh-axes", ["train", SFT, "--workdir={run}", "--config.mesh.ici.tensor=3"], "mesh"),
    (
        "pipeline-schedule",
        ["train", SFT, "--workdir={run}", "--config.model.pipeline_schedule=1F1B"],
        "pipeline_schedule='1F1B'; choose one of ('gpipe', '1f1b')",
    ),
    (
        "rl-group",
        ["train", GRPO, "--workdir={run}", "--config.rollout.num_generations=0"],
        "num_generations",
    ),
    ("env-name", ["train", GRPO, "--workdir={run}", "--config.env.name=calculater"], "calculater"),
    (
        "env-options-unknown",  # refused before the model loads, not at the first rollout
        [
            "train",
            GRPO,
            "--workdir={root}/env_run",
            "--config.model.checkpoint=",
            "--config.env.name=calculator",
            '--config.env.options={{"nope": 1}}',
        ],
        "env.options={{'nope': 1}}: calculator_env() got an unexpected keyword argument 'nope'",
    ),  # fmt: skip
    (
        "env-options-value",  # (was: every tool call an error, silently)
        [
            "train",
            GRPO,
            "--workdir={root}/env_run",
            "--config.model.checkpoint=",
            "--config.env.name=python_tool",
            '--config.env.options={{"timeout_s": -1}}',
        ],
        "python_tool needs timeout_s > 0",
    ),  # fmt: skip
    # paths: tokenizer, model directories, data files
    (
        "tokenizer-dir",
        ["train", SFT, "--workdir={run}", "--config.tokenizer={root}/nothing"],
        "{root}/nothing",
    ),
    (
        "hf-path-not-a-model",
        ["train", SFT, "--workdir={run}", "--config.model.hf_path={root}/not_a_model"],
        "not_a_model",
    ),
    (
        "hf-config-broken",
        ["train", SFT, "--workdir={run}", "--config.model.hf_path={root}/broken_hf"],
        "broken_hf/config.json",
    ),
    (
        "start-checkpoint",
        ["train", SFT, "--workdir={run}", "--config.model.checkpoint={root}/nothing"],
        "{root}/nothing",
    ),
    (
        "data-missing",
        ["train", "--config={root}/data.py:missing", "--workdir={root}/fresh"],
        "missing.jsonl",
    ),
    (
        "data-malformed",
        ["train", "--config={root}/data.py:malformed", "--workdir={root}/fresh"],
        "malformed.jsonl line 1: invalid JSON",
    ),
    (
        "data-no-text",
        ["train", "--config={root}/data.py:no_text", "--workdir={root}/fresh"],
        "no_text.jsonl",
    ),
    (
        "data-format",
        ["train", "--config={root}/data.py:unknown_format", "--workdir={root}/fresh"],
        "parquet-ish",
    ),
    (
        "other-model-in-workdir",
        ["train", SFT, "--workdir={run}", f"--config.tokenizer={ASSETS_DIR}/tokenizer"],
        "embed_dim: 96 -> 64",
    ),
    # generate
    ("generate-no-model", ["generate", "--prompt=hi"], "--model and one of --prompt"),
    (
        "generate-negative-tokens",
        ["generate", "--model={run}", "--prompt=hi", "--max_new_tokens=-5"],
        "max_new_tokens must be >= 1, got -5",
    ),
    (
        "generate-zero-tokens",
        ["generate", "--model={run}", "--prompt=hi", "--max-new-tokens=0"],
        "max_new_tokens must be >= 1, got 0",
    ),
    ("generate-top-p", ["generate", "--model={run}", "--prompt=hi", "--top_p=0"], "top_p"),
    (
        "generate-temperature",
        ["generate", "--model={run}", "--prompt=hi", "--temperature=-1"],
        "temperature must be a finite number >= 0",
    ),
    (
        "generate-temperature-nan",
        ["generate", "--model={run}", "--prompt=hi", "--temperature=nan"],
        "temperature must be a finite number >= 0 (0 is greedy), got nan",
    ),
    (
        "generate-temperature-infinity",
        ["generate", "--model={run}", "--prompt=hi", "--temperature=Infinity"],
        "got inf",
    ),
    (
        "generate-prompts-file",
        ["generate", "--model={run}", "--prompts-file={root}/nothing.jsonl"],
        "nothing.jsonl: no such file",
    ),
    (
        "generate-not-a-model",
        ["generate", "--model={root}/not_a_model", "--prompt=hi"],
        "not_a_model",
    ),
    (
        "generate-damaged-weights",
        ["generate", "--model={root}/damaged_hf", "--prompt=hi"],
        "damaged_hf/model.safetensors is not a readable safetensors file",
    ),
    (
        "generate-mesh",
        ["generate", "--model={run}", "--prompt=hi", "--mesh=fsdp=3"],
        "--mesh='fsdp=3'",
    ),
    # data tools and generate: an output that is an input, or another output, or exists
    (
        "decontaminate-out-is-the-eval-set",
        [
            "data",
            "decontaminate",
            "--input={root}/records.jsonl",
            "--eval={root}/ev.jsonl",
            "--out={root}/ev.jsonl",
        ],
        "--out={root}/ev.jsonl is also an input (--eval={root}/ev.jsonl)",
    ),
    (
        "decontaminate-report-is-the-input",
        [
            "data",
            "decontaminate",
            "--input={root}/records.jsonl",
            "--eval={root}/ev.jsonl",
            "--out={root}/new.jsonl",
            "--report={root}/records.jsonl",
        ],
        "--report={root}/records.jsonl is also an input (--input={root}/records.jsonl)",
    ),
    (
        "decontaminate-report-is-the-out",
        [
            "data",
            "decontaminate",
            "--input={root}/records.jsonl",
            "--eval={root}/ev.jsonl",
            "--out={root}/new.jsonl",
            "--report={root}/new.jsonl",
        ],
        "--report={root}/new.jsonl and --out={root}/new.jsonl are the same file",
    ),
    (
        "clean-out-is-the-input",
        ["data", "clean", "--input={root}/records.jsonl", "--out={root}/records.jsonl"],
        "is also an input (--input={root}/records.jsonl)",
    ),
    (
        "clean-out-in-the-input-glob",
        ["data", "clean", "--input={root}/rec*.jsonl", "--out={root}/records.jsonl"],
        "is also an input (--input={root}/rec*.jsonl)",
    ),
    (
        "clean-out-through-dot-dot",
        ["data", "clean", "--input={root}/records.jsonl", "--out={root}/run/../records.jsonl"],
        "is also an input",
    ),
    (
        "clean-out-is-a-symlink-to-the-input",
        ["data", "clean", "--input={root}/records.jsonl", "--out={root}/link.jsonl"],
        "--out={root}/link.jsonl is also an input",
    ),
    (
        "clean-out-is-a-hard-link-to-the-input",
        [
            "data",
            "clean",
            "--input={root}/records.jsonl",
            "--out={root}/hardlink.jsonl",
            "--overwrite",
        ],
        "--out={root}/hardlink.jsonl is also an input",
    ),
    (
        "clean-overrides-is-the-out",
        [
            "data",
            "clean",
            "--input={root}/records.jsonl",
            "--out={root}/ev.jsonl",
            "--overrides={root}/ev.jsonl",
            "--overwrite",
        ],
        "is also an input (--overrides={root}/ev.jsonl)",
    ),
    (
        "clean-stats-is-the-out",
        [
            "data",
            "clean",
            "--input={root}/records.jsonl",
            "--out={root}/new.jsonl",
            "--stats={root}/new.jsonl",
        ],
        "--stats={root}/new.jsonl and --out={root}/new.jsonl are the same file",
    ),
    (
        "clean-rejects-is-the-out",
        [
            "data",
            "clean",
            "--input={root}/records.jsonl",
            "--out={root}/new.jsonl",
            "--rejects={root}/new.jsonl",
        ],
        "--rejects={root}/new.jsonl and --out={root}/new.jsonl are the same file",
    ),
    (
        "clean-out-exists",
        ["data", "clean", "--input={root}/records.jsonl", "--out={root}/ev.jsonl"],
        "--out={root}/ev.jsonl exists; pass --overwrite to replace it",
    ),
    (
        "clean-workers",
        ["data", "clean", "--input={root}/records.jsonl", "--out={root}/new.jsonl", "--workers=-3"],
        "--workers=-3: give 0 (one per CPU core)",
    ),
    (
        "dedup-report-is-the-out",
        [
            "data",
            "dedup",
            "--input={root}/records.jsonl",
            "--out={root}/new.jsonl",
            "--report={root}/new.jsonl",
        ],
        "--report={root}/new.jsonl and --out={root}/new.jsonl are the same file",
    ),
    (
        "dedup-clusters-is-the-input",
        [
            "data",
            "dedup",
            "--input={root}/records.jsonl",
            "--out={root}/new.jsonl",
            "--clusters={root}/records.jsonl",
        ],
        "--clusters={root}/records.jsonl is also an input",
    ),
    (
        "dedup-report-exists",
        [
            "data",
            "dedup",
            "--input={root}/records.jsonl",
            "--out={root}/new.jsonl",
            "--report={root}/hard.jsonl",
        ],
        "--report={root}/hard.jsonl exists; pass --overwrite",
    ),
    (
        "dedup-workers",
        ["data", "dedup", "--input={root}/records.jsonl", "--out={root}/new.jsonl", "--workers=-3"],
        "--workers=-3",
    ),
    (
        "stratify-bucket-is-the-input",
        ["data", "stratify", "--input={root}/hard.jsonl", "--out={root}", "--score-field=s"],
        "--out={root} (hard.jsonl) is also an input (--input={root}/hard.jsonl)",
    ),
    (
        "build-out-is-a-file",
        ["data", "build", "--input={root}/records.jsonl", "--out={root}/records.jsonl"],
        "--out={root}/records.jsonl is a file",
    ),
    (
        "pairs-out-is-the-prompts",
        [
            "data",
            "pairs",
            "--model={run}",
            "--prompts={root}/prompts.jsonl",
            "--out={root}/prompts.jsonl",
        ],
        "--out={root}/prompts.jsonl is also an input (--prompts={root}/prompts.jsonl)",
    ),
    (
        "synth-out-exists",
        [
            "data",
            "synth",
            "--model={run}",
            "--prompts={root}/prompts.jsonl",
            "--out={root}/ev.jsonl",
        ],
        "--out={root}/ev.jsonl exists",
    ),
    (
        "cad-files-exist",
        ["data", "cad", "--out={root}/cad", "--sft=1", "--train=1", "--eval=1"],
        "--out={root}/cad (train.jsonl) exists; pass --overwrite",
    ),
    (
        "generate-out-is-the-prompts-file",
        [
            "generate",
            "--model={run}",
            "--prompts-file={root}/asked.jsonl",
            "--out={root}/asked.jsonl",
        ],
        "--out={root}/asked.jsonl is also an input (--prompts_file={root}/asked.jsonl)",
    ),
    (
        "generate-default-out-exists",
        ["generate", "--model={run}", "--prompts-file={root}/asked.jsonl"],
        "--out={root}/asked.completions.jsonl exists; pass --overwrite",
    ),
    # serve: flags refused before the model loads
    ("serve-port-range", ["serve", "--model={run}", "--port=70000"], "--port=70000: a port is 0"),
    ("serve-negative-port", ["serve", "--model={run}", "--port=-1"], "--port=-1"),
    (
        "serve-foreign-address",
        ["serve", "--model={run}", "--host=192.0.2.1", "--port=0"],
        "--host=192.0.2.1 --port=0: cannot listen there (Cannot assign requested address)",
    ),
    (
        "serve-max-request-samples",
        ["serve", "--model={run}", "--max-request-samples=0"],
        "--max-request-samples must be >= 1",
    ),
    ("serve-max-sequences", ["serve", "--model={run}", "--max-sequences=-1"], "--max-sequences"),
    (
        "serve-max-queue-tokens",
        ["serve", "--model={run}", "--max-queue-tokens=-5"],
        "--max-queue-tokens must be >= 0",
    ),
    ("serve-drain", ["serve", "--model={run}", "--drain-s=-1"], "--drain-s must be >= 0"),
    ("serve-num-blocks", ["serve", "--model={run}", "--num-blocks=-1"], "--num-blocks must be"),
    ("serve-speculative", ["serve", "--model={run}", "--speculative=-2"], "--speculative must"),
    (
        "serve-mtp-without-drafts",
        ["serve", "--model={run}", "--mtp", "--speculative=0"],
        "--mtp drafts tokens: drop --speculative=0",
    ),
    ("serve-preset", ["serve", "--model={run}", "--preset=fastest"], "unknown serve preset"),
    ("serve-slots", ["serve", "--model={run}", "--slots=-1"], "--slots must be >= 0"),
    (
        "serve-layered-kv-speculative",
        ["serve", "--model={run}", "--preset=latency", "--kv-dtype=int8_layered"],
        "--kv-dtype=int8_layered keeps recent tokens in a ring",
    ),
    (
        "generate-layered-kv-speculative",
        ["generate", "--model={run}", "--prompt=hi", "--kv-dtype=int8_layered", "--speculative=2"],
        "use --kv-dtype=int8 or --speculative=0",
    ),
    (
        "generate-mtp-without-drafts",
        ["generate", "--model={run}", "--prompt=hi", "--mtp", "--speculative=0"],
        "--mtp drafts tokens: drop --speculative=0",
    ),
    ("generate-kv-dtype", ["generate", "--model={run}", "--prompt=hi", "--kv-dtype=fp4"], "fp4"),
    ("serve-max-body", ["serve", "--model={run}", "--max-body-mb=0"], "--max-body-mb must be"),
    (
        "clean-out-suffix",
        ["data", "clean", "--input={root}/records.jsonl", "--out={root}/new.csv"],
        "new.csv: unsupported suffix '.csv'",
    ),
    (
        "dedup-missing-input",
        ["data", "dedup", "--input={root}/missing.jsonl", "--out={root}/new.jsonl"],
        "data source {root}/missing.jsonl does not exist",
    ),
    # paths
    (
        "workdir-is-a-file",
        ["train", SFT, "--workdir={root}/records.jsonl"],
        "--workdir={root}/records.jsonl is a file; give a folder",
    ),
    (
        "sweep-workdir-is-a-file",
        ["sweep", f"--config={REPO}/configs/sweeps/sft_lr_seeds.py", "--workdir={root}/ev.jsonl"],
        "--workdir={root}/ev.jsonl is a file",
    ),
    (
        "demo-workdir-is-a-file",
        ["demo", "--workdir={root}/hard.jsonl"],
        "--workdir={root}/hard.jsonl is a file",
    ),
    # eval, export, compile, sweep
    ("eval-no-target", ["eval", EVAL], "one of --workdir=DIR or --model=HF_DIR"),
    ("eval-not-a-run", ["eval", EVAL, "--model={root}/not_a_model"], "neither a training workdir"),
    ("eval-missing-workdir", ["eval", EVAL, "--workdir={root}/nothing"], "{root}/nothing"),
    ("export-no-out", ["export", "--workdir={run}"], "--out=HF_DIR are required"),
    (
        "export-into-a-workdir",
        ["export", "--workdir={run}", "--out={run}"],
        "holds no exported model; pick an empty directory",
    ),
    (
        "export-no-checkpoint",
        ["export", "--workdir={root}/not_a_model", "--out={root}/hf"],
        "no checkpoint",
    ),
    ("compile-topology", ["compile", SFT, "--topology=v9z-8"], "v9z-8"),
    (
        "compile-no-slices",
        ["compile", SFT, "--topology=v5p-8", "--num_slices=0"],
        "num_slices=0: a plan spans 1 or more slices",
    ),
    (
        "compile-negative-slices",
        ["compile", SFT, "--topology=v5p-8", "--num-slices=-2"],
        "num_slices=-2",
    ),
    (
        "sweep-no-workdir",
        ["sweep", f"--config={REPO}/configs/sweeps/sft_lr_seeds.py"],
        "--workdir=DIR are required",
    ),
]


@pytest.mark.parametrize("argv,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_message(argv, expected, inputs, capsys):
    run = inputs / "run"
    names = {"root": str(inputs), "run": str(run)}
    before = _tree(inputs)
    assert cli.main([a.format(**names) for a in argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert expected.format(**names) in err, err
    assert len(err.strip().splitlines()) <= 3, err  # the message and the --debug hint
    assert _tree(inputs) == before  # nothing written, nothing rewritten


def test_the_shell_sees_exit_code_2_and_debug_shows_the_traceback(inputs, capsys):
    argv = ["train", SFT, f"--workdir={inputs}/run", "--config.optimizer.learning_rate=nan"]
    shell = subprocess.run(
        [sys.executable, "-m", "posttrain", *argv], capture_output=True, text=True, cwd=REPO
    )
    assert shell.returncode == 2 and "Traceback" not in shell.stderr
    assert shell.stderr.startswith("posttrain train: config.optimizer.learning_rate: nan")
    assert cli.main([*argv, "--debug"]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err
