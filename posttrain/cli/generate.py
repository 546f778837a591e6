"""`posttrain generate`: sample from an HF model directory or a training workdir."""

from __future__ import annotations

import contextlib

from posttrain.cli._engine_flags import check_engine, define_engine, mtp_module
from posttrain.cli._flags import define_mesh, mesh, parse
from posttrain.cli._outputs import check_flags, define_overwrite
from posttrain.errors import UserError

HELP = (
    "Sample from an HF model directory or a training workdir: one streamed prompt, or a "
    "JSONL of prompts in batch.",
    [
        'posttrain generate --model=runs/sft_tiny --chat --prompt="What is 12 + 30?"',
        "posttrain generate --model=gs://bucket/run --prompts-file=prompts.jsonl "
        "--mesh=fsdp=4,tensor=2",
        "posttrain generate --model=HF_DIR --prompts-file=prompts.jsonl --out=out.jsonl --n=4 "
        "--temperature=1.0",
        "posttrain generate --model=HF_DIR --prompts-file=prompts.jsonl --slots=64 "
        "--kv-dtype=int8 --speculative=4",
    ],
)


def main(argv: list[str]) -> int:
    def define(flags, fv):
        flags.DEFINE_string("model", None, "HF model directory or training workdir", flag_values=fv)
        flags.DEFINE_string("prompt", None, "prompt text (streamed answer)", flag_values=fv)
        flags.DEFINE_string("prompts_file", None, "JSONL of prompts (batch mode)", flag_values=fv)
        flags.DEFINE_string("out", None, "batch-mode output JSONL (default: the prompts "
                            "file's name with .completions.jsonl)", flag_values=fv)  # fmt: skip
        define_overwrite(flags, fv)
        flags.DEFINE_bool(
            "chat", False, "wrap the prompt as a user turn of the chat template", flag_values=fv
        )
        flags.DEFINE_integer("max_new_tokens", 128, "tokens to generate", flag_values=fv)
        flags.DEFINE_float("temperature", 0.0, "0 is greedy", flag_values=fv)
        flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass", flag_values=fv)
        flags.DEFINE_integer("top_k", 0, "keep the k most likely tokens (0: all)", flag_values=fv)
        flags.DEFINE_integer("n", 1, "samples per prompt (batch mode)", flag_values=fv)
        flags.DEFINE_integer("seed", 0, "sampling seed", flag_values=fv)
        define_engine(
            flags, fv, slots_help="sequences decoded together in batch mode (0: 32)",
            speculative_help="draft tokens per speculative round (prompt lookup, or the "
            "model's MTP layer with --mtp); 0 (the default) for plain decoding",
        )  # fmt: skip
        define_mesh(fv)

    fv = parse(argv, define, HELP)
    if not fv.model or not (fv.prompt or fv.prompts_file):
        raise UserError("--model and one of --prompt / --prompts-file are required")
    import jax

    from posttrain import paths
    from posttrain.lora import load_model_and_tokenizer
    from posttrain.sampling import check_settings, default_out

    check_settings(  # before the model loads
        max_new_tokens=fv.max_new_tokens, temperature=fv.temperature, top_p=fv.top_p,
        top_k=fv.top_k, n=fv.n,
    )  # fmt: skip
    speculative = check_engine(fv, default_speculative=0)
    if fv.prompts_file and not paths.path(fv.prompts_file).is_file():
        raise UserError(f"--prompts-file={fv.prompts_file}: no such file")
    if fv.prompts_file:
        fv.out = fv.out or default_out(fv.prompts_file)
        check_flags(fv, inputs=("prompts_file",), outputs=("out",))

    devices = mesh(fv.mesh)
    with jax.set_mesh(devices) if devices is not None else contextlib.nullcontext():
        model, tokenizer = load_model_and_tokenizer(fv.model, mesh=devices)
        if model.config.nnx is not None and (speculative or fv.kv_dtype != "auto"):
            raise UserError(
                f"{fv.model} is a Flax NNX module, decoded without a KV cache: drop "
                "--kv-dtype, --speculative and --mtp"
            )
        module = mtp_module(fv.model, devices) if fv.mtp else None
        _generate(fv, model, tokenizer, speculative, module)
    return 0


def _generate(fv, model, tokenizer, speculative: int, mtp) -> None:
    from posttrain.sampling import EngineConfig, run_generate

    run_generate(
        model,
        tokenizer,
        prompt=fv.prompt,
        prompts_file=fv.prompts_file,
        out=fv.out,
        chat=fv.chat,
        max_new_tokens=fv.max_new_tokens,
        temperature=fv.temperature,
        top_p=fv.top_p,
        top_k=fv.top_k,
        n=fv.n,
        seed=fv.seed,
        engine=EngineConfig(slots=fv.slots or 32, num_blocks=fv.num_blocks, kv_dtype=fv.kv_dtype),
        speculative=speculative,
        mtp=mtp,
    )
