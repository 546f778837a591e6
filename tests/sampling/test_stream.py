"""Streaming (the CLI path) agrees with batch generation; `posttrain generate` end to end."""

import json
import os
import shutil

from posttrain import cli
from posttrain.data import load_tokenizer
from posttrain.demo import ASSETS_DIR
from posttrain.models import Transformer, get_preset, to_hf
from posttrain.sampling import generate, stream

TOKENIZER = load_tokenizer(f"{ASSETS_DIR}/tokenizer")
MODEL = Transformer.init(get_preset("tiny", attention="xla"), rng=7)


def _prompt(text):
    return TOKENIZER.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )


def test_streamed_text_equals_batch_generation():
    for question, temperature in [("What is 3 + 4?", 0.0), ("What is 10 - 12?", 0.8)]:
        ids = _prompt(question)
        pieces = list(
            stream(MODEL, TOKENIZER, ids, max_new_tokens=12, temperature=temperature, seed=3)
        )
        # generate() draws each step's key the same way (fold_in of the step), so a sampled
        # stream matches too.
        [[batch]] = generate(
            MODEL, TOKENIZER, [ids], max_new_tokens=12, temperature=temperature, seed=3
        )
        assert "".join(pieces) == batch.text
        assert len(pieces) >= 1


def test_cli_generate_streams_and_writes_jsonl(tmp_path, capsys):
    model_dir = tmp_path / "model"
    to_hf(MODEL, str(model_dir))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(ASSETS_DIR, "tokenizer", name), model_dir / name)
    assert (
        cli.main(
            [
                "generate",
                f"--model={model_dir}",
                "--prompt=What is 1 + 1?",
                "--chat",
                "--max-new-tokens=5",
            ]
        )
        == 0
    )
    streamed = capsys.readouterr().out.rstrip("\n")
    [[expected]] = generate(MODEL, TOKENIZER, [_prompt("What is 1 + 1?")], max_new_tokens=5)
    assert streamed == expected.text

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"What is 2 + 2?"\n{"prompt": "What is 5 - 9?"}\n')
    out = tmp_path / "out.jsonl"
    assert (
        cli.main(
            [
                "generate",
                f"--model={model_dir}",
                f"--prompts-file={prompts}",
                "--chat",
                f"--out={out}",
                "--n=2",
                "--temperature=1.0",
                "--max-new-tokens=4",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["What is 2 + 2?"] * 2 + ["What is 5 - 9?"] * 2
    assert all(r["finish_reason"] in ("stop", "length") and r["num_tokens"] <= 4 for r in rows)


def test_cli_generate_takes_the_engines_options(tmp_path, capsys):
    """--slots, --kv-dtype and --speculative reach the engine: speculative greedy answers are
    the plain ones (prompt-lookup drafts only save forwards), streamed and in batch; an int8
    KV cache answers every prompt too."""
    model_dir = tmp_path / "model"
    to_hf(MODEL, str(model_dir))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(ASSETS_DIR, "tokenizer", name), model_dir / name)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'"What is {i} + {i}?"\n' for i in range(5)))
    base = ["generate", f"--model={model_dir}", "--chat", "--max-new-tokens=12"]
    outs = {}
    for name, extra in {"plain": [], "drafted": ["--speculative=3", "--slots=2"],
                        "int8": ["--kv-dtype=int8"]}.items():  # fmt: skip
        outs[name] = tmp_path / f"{name}.jsonl"
        args = [*base, f"--prompts-file={prompts}", f"--out={outs[name]}", *extra]
        assert cli.main(args) == 0
        said = capsys.readouterr().out
        assert ("drafted tokens accepted" in said) == (name == "drafted"), said
    rows = {k: [json.loads(line) for line in v.read_text().splitlines()] for k, v in outs.items()}
    assert rows["drafted"] == rows["plain"] and len(rows["plain"]) == 5
    assert len(rows["int8"]) == 5
    capsys.readouterr()
    assert cli.main([*base, "--prompt=What is 1 + 1?", "--speculative=2"]) == 0
    drafted = capsys.readouterr().out
    assert cli.main([*base, "--prompt=What is 1 + 1?"]) == 0
    assert drafted == capsys.readouterr().out
