"""The eval harness on a short SFT run: its numbers equal the demo's own measures (greedy exact
match, prefers-chosen, the SFT evaluator's loss), pass@k by hand, the refusal detector, the
per-checkpoint report, periodic evaluation inside training and `posttrain eval`."""

import csv
import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest

from posttrain.cli.eval import main as cli
from posttrain.config import ConfigError, build, load_config_file
from posttrain.data import SourceConfig, load_tokenizer
from posttrain.data._formats import encode_prompt
from posttrain.demo import ASSETS_DIR, is_correct
from posttrain.errors import UserError
from posttrain.eval import (
    REFUSAL_PHRASES,
    EvalConfig,
    RefusalDetector,
    check_files,
    evaluate,
    evaluate_checkpoints,
    greedy_exact_match,
    load_eval_config,
    prefers_chosen,
)
from posttrain.methods import SFTConfig, run_from_config, run_sft
from posttrain.rewards import pass_at_k
from posttrain.sampling import generate
from posttrain.train import load_checkpoint_model, read_metrics
from tests.train.conftest import REPO, small_config

EVAL_JSONL = str(ASSETS_DIR / "eval.jsonl")
# configs/eval.py:demo, shrunk to the fixture's files and the SFT run's rows.
SUITE = """
from posttrain.config import load_config_file

def get_config(preset=""):
    c = load_config_file({demo!r})
    c.general.eval.sources[0].path = {problems!r}
    c.general.eval.max_len = 64  # the SFT run's rows (tests/train/conftest.py SMALL)
    c.general.eval.batch_size = 8
    c.target.arithmetic.path = {problems!r}
    c.target.preferences.path = {pairs!r}
    c.safety.example.max_new_tokens = 4
    c.progress = False
    return c
"""
N = 16  # held-out problems (and pairs) the suite scores


def _records(path, limit=0):
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:limit] if limit else rows


def always_one(record, completion):
    """A reward that accepts everything (importable by reference)."""
    return 1.0, {}


def with_parts(record, completion):
    """A reward made of named parts (as `code_quality_reward`'s lint components)."""
    return 1.0, {"components": {"chars": float(len(completion)), "has_digit": float(
        any(c.isdigit() for c in completion))}}  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory, devices):
    """An 8-step SFT run with checkpoints at 4 and 8, the eval loss and the suite at both."""
    root = tmp_path_factory.mktemp("eval")
    problems = _records(EVAL_JSONL, N)
    pairs = [
        {"prompt": r["prompt"], "chosen": r["answer"], "rejected": str(int(r["answer"]) + 1)}
        for r in problems
    ]
    for name, rows in (("problems", problems), ("pairs", pairs)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    suite = root / "suite.py"
    demo = os.path.join(REPO, "configs", "eval.py") + ":demo"
    paths = {"problems": str(root / "problems.jsonl"), "pairs": str(root / "pairs.jsonl")}
    suite.write_text(SUITE.format(demo=demo, **paths))
    config = small_config(train__steps=8, train__eval_every=4, checkpoint__every=4)
    config.eval_data = [{"path": paths["problems"], "weight": 1.0, "domain": "arithmetic"}]
    config.eval_suite = f"{suite}:x"
    workdir = root / "sft"
    run_from_config(config, str(workdir))
    tokenizer = load_tokenizer(ASSETS_DIR / "tokenizer")
    return {"workdir": str(workdir), "suite": f"{suite}:x", "pairs": pairs,
            "problems": problems, "tokenizer": tokenizer}  # fmt: skip


@pytest.fixture(scope="module")
def report(run):
    """`evaluate_checkpoints` over the whole run."""
    return evaluate_checkpoints(run["workdir"], load_eval_config(run["suite"]))


def test_matches_the_demos_measures(run, report):
    assert [r["step"] for r in report] == [4, 8]
    metrics = report[-1]["metrics"]
    model = load_checkpoint_model(run["workdir"], 8)
    tokenizer = run["tokenizer"]
    # Accuracy: the demo's greedy exact match, on the same problems.
    expected = greedy_exact_match(model, tokenizer, run["problems"]).mean()
    assert metrics["target/arithmetic/accuracy"] == expected
    assert metrics["target/arithmetic/accuracy/arithmetic"] == expected
    # Preferences: the demo's function, and summed log-probs computed here by hand.
    share = metrics["target/preferences/prefers_chosen"]
    assert share == prefers_chosen(model, tokenizer, run["pairs"])
    assert share == np.mean(_hand_wins(model, tokenizer, run["pairs"]))
    # Loss: the SFT evaluator's eval_loss at the same step, on the same rows.
    logged = {r["step"]: r for r in read_metrics(run["workdir"], "eval")}
    np.testing.assert_allclose(metrics["general/eval/loss"], logged[8]["eval_loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics["general/eval/perplexity"], np.exp(logged[8]["eval_loss"]),
                               rtol=1e-5)  # fmt: skip
    assert metrics["general/eval/tokens"] == logged[8]["eval_tokens"]


def _hand_wins(model, tokenizer, pairs):
    """Whether chosen's summed log-prob beats rejected's, from one plain forward pass."""
    rows, spans = [], []
    for pair in pairs:
        prompt = encode_prompt(pair, tokenizer)
        for key in ("chosen", "rejected"):
            turn = {"role": "assistant", "content": pair[key]}
            ids, mask = tokenizer.encode_chat([*pair["prompt"], turn])
            assert ids[: len(prompt)] == prompt
            rows.append(ids)
            spans.append([t for t in range(len(prompt), len(ids)) if mask[t]])
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)  # right padding: causal
    for i, ids in enumerate(rows):
        tokens[i, : len(ids)] = ids
    logp = np.asarray(jax.nn.log_softmax(model(tokens), axis=-1))
    sums = [sum(logp[i, t - 1, rows[i][t]] for t in span) for i, span in enumerate(spans)]
    return [chosen > rejected for chosen, rejected in zip(sums[::2], sums[1::2], strict=True)]


def test_periodic_suite_inside_training(run, report):
    evals = {r["step"]: r for r in read_metrics(run["workdir"], "eval")}
    assert sorted(evals) == [4, 8]
    for row in report:  # the suite on the live params = the harness on the checkpoint
        logged = evals[row["step"]]
        for name, value in row["metrics"].items():
            assert f"suite/{name}" in logged, name
            if name.startswith("general/"):
                np.testing.assert_allclose(logged[f"suite/{name}"], value, rtol=1e-5)
        for name in ("target/arithmetic/accuracy", "target/preferences/prefers_chosen"):
            assert abs(logged[f"suite/{name}"] - row["metrics"][name]) <= 1 / N, name


def test_pass_at_k_by_hand(run, report):
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(4, 0, 3) == 0.0 and pass_at_k(4, 2, 3) == 1.0
    # The harness's pass@1/pass@4 over the same 4 samples of each problem, scored here.
    model = load_checkpoint_model(run["workdir"], 8)
    records, tokenizer = run["problems"], run["tokenizer"]
    prompts = [encode_prompt(r, tokenizer) for r in records]
    samples = generate(model, tokenizer, prompts, max_new_tokens=8, temperature=1.0, n=4, seed=0)
    correct = [sum(is_correct(c.text, r) for c in s) for r, s in zip(records, samples, strict=True)]
    metrics = report[-1]["metrics"]
    assert metrics["target/arithmetic/pass@1"] == pytest.approx(np.mean(correct) / 4)
    assert metrics["target/arithmetic/pass@4"] == pytest.approx(np.mean(np.asarray(correct) > 0))


def test_refusal_detector():
    detect = RefusalDetector()
    assert detect("I’m sorry, but I can’t help with that.")  # typographic apostrophes
    assert detect("As an AI   language model,\nI cannot do this")
    assert not detect("42") and not detect("Sure! Here is the answer: 7")
    assert RefusalDetector(phrases=(), regex=r"^\s*no\b")("  No way.")
    assert not RefusalDetector(phrases=(), regex=r"^\s*no\b")("I know")
    assert RefusalDetector(phrases=("Nope",))("nope.") and "i cannot" in REFUSAL_PHRASES
    with pytest.raises(ValueError, match="not a regular expression"):
        RefusalDetector(regex="(")


def test_safety_rates(run):
    model = load_checkpoint_model(run["workdir"], 8)
    base = load_config_file(run["suite"])
    safety = {"general": {}, "target": {}, "progress": False}

    def rates(**fields):
        task = {**base.safety.example.to_dict(), **fields}
        metrics = evaluate(model, run["tokenizer"], {**safety, "safety": {"s": task}})
        return metrics["safety/s/refusal_rate"], metrics["safety/s/compliance_rate"]

    assert rates(refusal_regex="^") == (1.0, 0.0)  # everything refuses, even ""
    assert rates(builtin_phrases=False, refusal_phrases=["zzqq"]) == (0.0, 1.0)
    always = {"rewards": {"always": [f"{__name__}:always_one"]}}
    task = {**base.safety.example.to_dict(), "refusal_domain": "always"}
    metrics = evaluate(model, run["tokenizer"], {**safety, **always, "safety": {"s": task}})
    assert metrics["safety/s/refusal_rate"] == 1.0 and metrics["safety/s/compliance_rate"] == 0.0
    assert metrics["safety/s/examples"] == 12


def test_a_mapped_dataset_folder_is_a_task_as_its_jsonl(run, report, tmp_path):
    """The suite's held-out problems as a Hub-layout Parquet folder (the card's configs name
    the split; other column names, mapped back) and its pairs as a `save_to_disk` folder: the
    same loss, accuracy and preference share as the suite's JSONL tasks at step 8."""
    import datasets

    names = {"prompt": "question", "answer": "solution", "messages": "conversation"}
    renamed = [{names.get(k, k): v for k, v in r.items()} for r in run["problems"]]
    hub = tmp_path / "hub"
    datasets.Dataset.from_list(renamed).to_parquet(hub / "held_out" / "part-0.parquet")
    datasets.Dataset.from_list(renamed[:2]).to_parquet(hub / "train" / "part-0.parquet")
    (hub / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
        "    path: train/*.parquet\n  - split: held_out\n    path: held_out/*.parquet\n---\n"
    )
    pair_names = {"chosen": "preferred", "rejected": "dispreferred"}
    datasets.Dataset.from_list(
        [{pair_names.get(k, k): v for k, v in p.items()} for p in run["pairs"]]
    ).save_to_disk(tmp_path / "pairs")
    suite = load_eval_config(run["suite"])
    folder = {"path": str(hub), "split": "held_out", "columns": names}
    general = dataclasses.replace(suite.general[0], sources=(SourceConfig(**folder),))
    arithmetic, preferences = suite.target
    target = (
        dataclasses.replace(arithmetic, num_samples=0, pass_k=(), **folder),
        dataclasses.replace(preferences, path=str(tmp_path / "pairs"), columns=pair_names),
    )
    config = dataclasses.replace(suite, general=(general,), target=target, safety=())
    metrics = evaluate(load_checkpoint_model(run["workdir"], 8), run["tokenizer"], config)
    expected = report[-1]["metrics"]
    for key in ("general/eval/loss", "general/eval/tokens", "target/arithmetic/accuracy",
                "target/arithmetic/examples", "target/preferences/prefers_chosen"):  # fmt: skip
        assert metrics[key] == expected[key], key


def test_verifier_scoring(run):
    model = load_checkpoint_model(run["workdir"], 8)
    task = {"path": EVAL_JSONL, "max_new_tokens": 8, "max_examples": N}
    config = {"target": {"t": task}, "progress": False}
    metrics = evaluate(model, run["tokenizer"], config)
    records = run["problems"]
    texts = [s[0].text for s in generate(model, run["tokenizer"],
             [encode_prompt(r, run["tokenizer"]) for r in records], max_new_tokens=8)]  # fmt: skip
    expected = np.mean([is_correct(t, r) for t, r in zip(texts, records, strict=True)])
    assert metrics["target/t/accuracy"] == expected
    always = {"rewards": {"arithmetic": [f"{__name__}:always_one"]}}
    assert evaluate(model, run["tokenizer"], {**config, **always})["target/t/accuracy"] == 1.0
    # A reward's components are reported per task and domain: their means over the records.
    parts = evaluate(model, run["tokenizer"],
                     {**config, "rewards": {"arithmetic": [f"{__name__}:with_parts"]}})  # fmt: skip
    assert parts["target/t/reward_parts/arithmetic/chars"] == pytest.approx(
        np.mean([len(t) for t in texts]))  # fmt: skip
    assert parts["target/t/reward_parts/arithmetic/has_digit"] == pytest.approx(
        np.mean([any(c.isdigit() for c in t) for t in texts]))  # fmt: skip
    assert parts["target/t/reward_errors"] == 0.0


def test_the_suites_engine_settings_reach_its_completions(run):
    """`engine` (rows, int8 KV, prompt-lookup drafts) configures the decoding of a suite's
    completions: speculative greedy answers are the plain ones, so the accuracy is too; an
    engine setting out of range is one ConfigError naming it."""
    model = load_checkpoint_model(run["workdir"], 8)
    task = {"path": EVAL_JSONL, "max_new_tokens": 8, "max_examples": N}
    plain = evaluate(model, run["tokenizer"], {"target": {"t": task}, "progress": False})
    drafted = {"slots": 3, "chunk": 2, "speculative": 3}
    config = {"target": {"t": task}, "progress": False, "engine": drafted}
    assert evaluate(model, run["tokenizer"], config) == plain
    config["engine"] = {"slots": 0}  # a row for every sample of a generate call
    assert evaluate(model, run["tokenizer"], config) == plain
    config["engine"] = {"num_blocks": 1}  # (reaches the engine: a pool too small for a row)
    with pytest.raises(ValueError, match="engine num_blocks=1 cannot hold one sequence"):
        evaluate(model, run["tokenizer"], config)
    for engine, message in [
        ({"slots": -1}, "engine slots must be >= 0"),  # (0: sized to the work)
        ({"kv_dtype": "int8_layered", "speculative": 2}, "engine kv_dtype=.int8_layered. keeps"),
    ]:
        with pytest.raises(ConfigError, match=rf"config\.engine: {message}"):
            EvalConfig.from_config({"target": {"t": task}, "engine": engine})


def test_report_has_one_row_per_checkpoint(run, report, capsys):
    out = os.path.join(run["workdir"], "eval")
    lines = _records(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in lines] == [4, 8]
    with open(os.path.join(out, "table.csv")) as f:
        table = list(csv.reader(f))
    names = list(report[0]["metrics"])
    assert table[0] == ["step", *names] and [row[0] for row in table[1:]] == ["4", "8"]
    assert (
        float(table[2][1 + names.index("target/arithmetic/accuracy")])
        == (report[1]["metrics"]["target/arithmetic/accuracy"])
    )
    md = open(os.path.join(out, "table.md")).read().splitlines()
    assert len(md) == 4 and md[0].startswith("| step | general/eval/loss |")
    # `posttrain eval --step=8` replaces that row; the table keeps one row per checkpoint.
    argv = ["posttrain eval", f"--workdir={run['workdir']}", f"--config={run['suite']}",
            "--step=8", "--config.safety.example.refusal_regex=^"]  # fmt: skip
    assert cli(argv) == 0
    printed = capsys.readouterr().out
    assert "general" in printed and "target" in printed and "safety" in printed
    lines = _records(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in lines] == [4, 8]
    assert lines[0]["metrics"]["safety/example/refusal_rate"] == 0.0
    assert lines[1]["metrics"]["safety/example/refusal_rate"] == 1.0


def test_cli_usage(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        cli(["posttrain eval", "--help"])
    assert exit_.value.code == 0
    assert "posttrain eval --workdir=runs/demo/sft --config=configs/eval.py:demo" in (
        capsys.readouterr().out
    )
    config = os.path.join(REPO, "configs", "eval.py") + ":demo"
    with pytest.raises(UserError, match="one of --workdir"):
        cli(["posttrain eval", f"--config={config}"])
    with pytest.raises(FileNotFoundError, match="neither a training workdir"):
        cli(["posttrain eval", f"--config={config}", f"--model={tmp_path}"])


def test_configs():
    for preset in ("demo", "template"):
        config = load_eval_config(os.path.join(REPO, "configs", "eval.py") + f":{preset}")
        assert config.general and config.target and config.safety
    demo = load_config_file(os.path.join(REPO, "configs", "eval.py") + ":demo")
    demo.target.preferences.path = "/nonexistent/pairs.jsonl"
    with pytest.raises(FileNotFoundError, match="target/preferences: /nonexistent"):
        check_files(EvalConfig.from_config(demo))
    demo.target.arithmetic.kind = "multiple_choice"
    with pytest.raises(ConfigError, match="kind='multiple_choice'"):
        EvalConfig.from_config(demo)
    with pytest.raises(ConfigError, match="pass_k"):
        EvalConfig.from_config({"target": {"t": {"path": "x", "num_samples": 2, "pass_k": [4]}}})
    with pytest.raises(ConfigError, match="no tasks"):
        EvalConfig.from_config({})
    sft = load_config_file(os.path.join(REPO, "configs", "sft.py") + ":tiny")
    sft.eval_data, sft.eval_suite = [], "configs/eval.py:demo"
    with pytest.raises(ConfigError, match="eval_suite is set without eval_data"):
        build(SFTConfig, {k: v for k, v in sft.items() if k != "method"})


def test_run_sft_without_the_suite_evaluator_says_how_to_get_one(tmp_path):
    """train cannot import eval (a sibling that imports it): the suite comes from drivers."""
    sft = small_config(checkpoint__keep_best=0)
    sft.eval_suite = "configs/eval.py:demo"
    config = build(SFTConfig, {k: v for k, v in sft.items() if k != "method"})
    with pytest.raises(ConfigError, match="suite=posttrain.eval.suite_evaluator"):
        run_sft(config, str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run")  # refused before anything was written


def test_a_checkpoint_sharded_over_fsdp_and_tensor_evaluates_and_generates_as_on_one_device(
    run, tmp_path
):
    """`posttrain eval` and `posttrain generate --mesh=fsdp=4,tensor=2` (8 fake devices) read the
    checkpoint onto the mesh and give the one-device greedy results."""
    from posttrain.cli.generate import main as generate_cli
    from posttrain.parallel import MeshConfig, make_mesh

    mesh = make_mesh(MeshConfig.from_dict({"fsdp": 4, "tensor": 2}))
    sharded = load_checkpoint_model(run["workdir"], 8, mesh=mesh)
    q = sharded.params["layers"]["attn"]["q"]
    assert q.sharding.mesh.shape == mesh.shape and len({d for d in q.sharding.device_set}) == 8
    assert q.addressable_shards[0].data.size * 4 <= q.size  # each device holds a part

    one = evaluate_checkpoints(run["workdir"], run["suite"], 8, out_dir=str(tmp_path / "one"))
    config = run["suite"]
    cli(["posttrain eval", f"--config={config}", f"--workdir={run['workdir']}", "--step=8",
         f"--out={tmp_path / 'mesh'}", "--mesh=fsdp=4,tensor=2"])  # fmt: skip
    mesh_rows = [json.loads(line) for line in open(tmp_path / "mesh" / "metrics.jsonl")]
    a, b = one[0]["metrics"], mesh_rows[0]["metrics"]
    assert a.keys() == b.keys()
    for key in a:
        if key.endswith(("accuracy", "prefers_chosen", "examples", "tokens", "rate")):
            assert a[key] == b[key], key  # greedy answers, counts
        else:
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, err_msg=key)

    prompts = tmp_path / "prompts.jsonl"
    questions = [f"What is {i} + {2 * i + 3}?" for i in range(5)]
    prompts.write_text("".join(json.dumps(q) + "\n" for q in questions) + '{"prompt": "7 - 2"}\n')
    outs = {}
    for name, extra in (("one", []), ("mesh", ["--mesh=fsdp=4,tensor=2"])):
        out = tmp_path / f"{name}.jsonl"
        flags = [f"--prompts-file={prompts}", f"--out={out}", "--max-new-tokens=12", *extra]
        generate_cli(["posttrain generate", f"--model={run['workdir']}", "--chat", *flags])
        outs[name] = [json.loads(line) for line in open(out)]
    assert len(outs["one"]) == 6 and outs["one"] == outs["mesh"]
    prompts.write_text('{"question": "1 + 1"}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:1: a line must be a JSON string"):
        generate_cli(
            ["posttrain generate", f"--model={run['workdir']}", f"--prompts-file={prompts}"]
        )
    with pytest.raises(UserError, match="--mesh='fsdp=3'"):
        generate_cli(["posttrain generate", f"--model={run['workdir']}", "--prompt=1",
                      "--mesh=fsdp=3"])  # fmt: skip


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (the cad sandbox)")
def test_a_cad_task_draws_its_completions_parts_in_the_report(tmp_path, gcs_bucket):
    """A target task of `cad` records saves a grid of the parts its first `renders` greedy
    completions build, per checkpoint: a random model's build none ("no part" cells, no part
    colour); a completion that is the reference script draws its part."""
    from PIL import Image

    from posttrain import paths
    from posttrain.eval._tasks import write_cad_renders
    from posttrain.models import Transformer, get_preset, to_hf
    from posttrain.rewards._cad_tasks import make_cad_task

    def part_colour(rgb):
        return rgb[..., 2].astype(int) - rgb[..., 0] > 40

    tasks = [make_cad_task(i, 1) for i in range(3)]
    (tmp_path / "cad.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    to_hf(Transformer.init(get_preset("tiny"), 0), str(tmp_path / "hf"))
    task = {"path": str(tmp_path / "cad.jsonl"), "max_new_tokens": 4, "renders": 2}
    rows = evaluate_checkpoints(str(tmp_path / "hf"), {"target": {"cad": task}, "progress": False},
                                tokenizer=str(ASSETS_DIR / "tokenizer"),
                                out_dir=str(tmp_path / "eval"))  # fmt: skip
    assert rows[0]["metrics"]["target/cad/accuracy"] == 0.0
    grid = np.asarray(Image.open(tmp_path / "eval" / "renders" / "cad_model.png").convert("RGB"))
    assert grid.shape == (256, 2 * 256, 3) and not part_colour(grid).any()
    texts = [f"```python\n{tasks[0]['reference']}```", "", "not a script"]
    path = write_cad_renders(["cad", "math", "cad"], texts, np.array([1.0, 0.0, 0.0]),
                             str(tmp_path / "direct" / "grid.png"), limit=8)  # fmt: skip
    grid = np.asarray(Image.open(path).convert("RGB"))
    assert grid.shape == (256, 2 * 256, 3)  # the two cad records
    assert part_colour(grid[:, :256]).any() and not part_colour(grid[:, 256:]).any()
    assert write_cad_renders(["math"], [""], np.zeros(1), str(tmp_path / "n.png"), limit=8) is None
    local = write_cad_renders(["cad"], texts[:1], np.ones(1), str(tmp_path / "g.png"), limit=1)
    remote = write_cad_renders(["cad"], texts[:1], np.ones(1), f"{gcs_bucket}/r/g.png", limit=1)
    assert paths.path(remote).read_bytes() == open(local, "rb").read()  # via a local temp file
