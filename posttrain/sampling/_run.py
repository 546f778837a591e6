"""`posttrain generate`'s work on a loaded model: stream one prompt, or sample a file of prompts
into a JSONL (loading a workdir's checkpoint is `posttrain.train.load_model_and_tokenizer`)."""

from __future__ import annotations

import json
import os
import sys

from posttrain import paths
from posttrain.sampling._completion import check_settings
from posttrain.sampling._continuous import generate_continuous
from posttrain.sampling._engine_config import EngineConfig
from posttrain.sampling._speculative import drafter_for
from posttrain.sampling._stream import stream

FILE_ENGINE = EngineConfig(slots=32)  # a prompts file's rows decoded together


def _render(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )
    return tokenizer.encode(prompt)


def default_out(prompts_file: str) -> str:
    """Where `generate` writes a prompts file's completions without --out."""
    return os.path.splitext(prompts_file)[0] + ".completions.jsonl"


def run_generate(
    model,
    tokenizer,
    *,
    prompt: str | None = None,
    prompts_file: str | None = None,
    out: str | None = None,
    chat: bool = False,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    n: int = 1,
    seed: int = 0,
    engine: EngineConfig = FILE_ENGINE,
    speculative: int = 0,
    mtp=None,
) -> None:
    """Streams one prompt's continuation to stdout, or writes a JSONL of completions for a
    file of prompts (one JSON string or {"prompt": ...} object per line), on the engine with
    `engine`'s rows and KV cache, drafting `speculative` tokens a round (prompt lookup, or the
    model's `mtp` module) when > 0."""
    drafter = drafter_for(speculative, mtp)
    settings = dict(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k
    )
    check_settings(**settings, n=n)
    if prompts_file is None:
        if prompt is None:
            raise ValueError("give --prompt=TEXT or --prompts-file=FILE")
        for piece in stream(
            model, tokenizer, _render(tokenizer, prompt, chat), seed=seed,
            kv_dtype=engine.kv_dtype, drafter=drafter, **settings,
        ):  # fmt: skip
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return
    lines = paths.path(prompts_file).read_text().splitlines()
    texts = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line) if line.strip() else None
        except ValueError as e:
            raise ValueError(f"{prompts_file}:{number}: not JSON ({e})") from None
        text = row.get("prompt") if isinstance(row, dict) else row
        if line.strip() and not isinstance(text, str):
            raise ValueError(
                f"{prompts_file}:{number}: a line must be a JSON string or an object with a "
                f'string "prompt", got {line[:80]!r}'
            )
        texts += [text] if line.strip() else []
    ids = [_render(tokenizer, t, chat) for t in texts]
    stats: dict = {}
    # The paged engine: prompts of any mix of lengths, n samples share their prefill.
    results = generate_continuous(
        model, tokenizer, ids, n=n, seed=seed, slots=engine.slots, num_blocks=engine.num_blocks,
        kv_dtype=engine.kv_dtype, drafter=drafter, stats=stats, **settings,
    )  # fmt: skip
    out = out or default_out(prompts_file)
    records = [
        {
            "prompt": text,
            "completion": c.text,
            "finish_reason": c.finish_reason,
            "num_tokens": len(c.token_ids),
        }
        for text, samples in zip(texts, results, strict=True)
        for c in samples
    ]
    paths.write_text(out, "".join(json.dumps(r) + "\n" for r in records))
    drafts = (
        f"; speculative decoding: {stats['accepted']} of {stats['proposed']} drafted tokens "
        f"accepted, {stats['generated_tokens']} tokens in {stats['rounds']} forwards"
        if drafter is not None
        else ""
    )
    print(f"wrote {sum(len(s) for s in results)} completions to {out}{drafts}")
