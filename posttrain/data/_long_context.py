"""Synthetic long-context tasks from any text corpus: needle retrieval, several needles at once
(cross-paragraph), and key-value lookup, at set lengths (in tokens) and depths.

    paragraphs = read_paragraphs(["docs/*.md"])
    records = long_context_records(paragraphs, tokenizer, kind="needle",
                                   lengths=[1024, 4096], depths=[0.0, 0.5, 1.0], per_cell=8)

Each record is a chat example in both shapes posttrain reads: `messages` (SFT: the user turn
holds the context and the question, the assistant turn the answer) and `prompt` + `answer`
(evaluation and RL), with `domain`, `kind`, `length` (the prompt's tokens) and `depth` (where
the asked fact sits: 0 = start of the context, 1 = end). Lengths are measured with the model's
tokenizer; a record comes out at most its target, short of it by less than the paragraphs that
no longer fit (64 are tried).

Kinds:
  needle        one fact ("The special magic number for <key> is <value>.") hidden among the
                corpus's paragraphs; asks for the value.
  multi_needle  `needles` facts at depths spread around the asked one; asks for all values in
                order (the answer joins them with ", ").
  kv            no corpus: lines "<key>: <value>" of random keys and values; asks one key's.
"""

from __future__ import annotations

import json
import string
from collections.abc import Sequence

import numpy as np

from posttrain import paths

KINDS = ("needle", "multi_needle", "kv")
DOMAIN = "long_context"


def read_paragraphs(patterns: Sequence[str], *, min_chars: int = 40) -> list[str]:
    """Paragraphs of text files (split at blank lines) or JSONL files (each line's "text"),
    matched by glob patterns (local or gs://); shorter than `min_chars` are dropped."""
    out = []
    for pattern in patterns:
        files = sorted(paths.glob(pattern))
        if not files:
            raise FileNotFoundError(f"no haystack file matches {pattern!r}")
        for file in files:
            text = paths.path(file).read_text()
            if str(file).endswith(".jsonl"):
                chunks = [json.loads(line).get("text", "") for line in text.splitlines() if line]
            else:
                chunks = text.split("\n\n")
            out += [" ".join(c.split()) for c in chunks if len(c.strip()) >= min_chars]
    if not out:
        raise ValueError(f"no paragraph of {min_chars}+ characters in {list(patterns)}")
    return out


def _word(rng, n: int) -> str:
    return "".join(rng.choice(list(string.ascii_lowercase), n))


def _number(rng, digits: int) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits))


def _needle(key: str, value: str) -> str:
    return f"The special magic number for {key} is {value}."


def long_context_records(
    paragraphs: Sequence[str],
    tokenizer,
    *,
    kind: str = "needle",
    lengths: Sequence[int] = (1024,),
    depths: Sequence[float] = (0.0, 0.5, 1.0),
    per_cell: int = 4,
    needles: int = 3,
    key_chars: int = 6,
    value_digits: int = 7,
    seed: int = 0,
) -> list[dict]:
    """`per_cell` records for every (length, depth) pair; see the module docstring.

    Args:
      paragraphs: the haystack (`read_paragraphs`); unused by "kv".
      tokenizer: a `posttrain.data.Tokenizer`: lengths are its tokens of the rendered prompt.
      kind: one of KINDS.
      lengths: target prompt lengths in tokens.
      depths: where the asked fact sits, in [0, 1].
      per_cell: records per (length, depth).
      needles: facts per "multi_needle" record.
      key_chars, value_digits: sizes of the random keys (letters) and values (digits).
      seed: all randomness.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; choose one of {KINDS}")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths must lie in [0, 1], got {list(depths)}")
    if kind != "kv" and not paragraphs:
        raise ValueError(f"kind={kind!r} needs haystack paragraphs (read_paragraphs)")
    rng = np.random.RandomState(seed)
    costs = _Costs(tokenizer)
    records = []
    for length in lengths:
        for depth in depths:
            for _ in range(per_cell):
                build = _kv if kind == "kv" else _haystack
                records.append(build(rng, paragraphs, costs, kind, length, depth, needles,
                                     key_chars, value_digits))  # fmt: skip
    return records


class _Costs:
    """Token counts of text pieces and of whole prompts, with the pieces' counts cached."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def piece(self, text: str) -> int:
        if text not in self.cache:
            self.cache[text] = len(self.tokenizer.encode(text, add_special_tokens=False))
        return self.cache[text]

    def prompt(self, content: str) -> int:
        messages = [{"role": "user", "content": content}]
        return len(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def _record(content: str, answer: str, kind: str, length: int, depth: float, costs) -> dict:
    prompt = [{"role": "user", "content": content}]
    return {
        "messages": [*prompt, {"role": "assistant", "content": answer}],
        "prompt": prompt,
        "answer": answer,
        "domain": DOMAIN,
        "kind": kind,
        "length": costs.prompt(content),
        "target_length": length,
        "depth": depth,
    }


def _fill(pieces: list[str], budget: int, costs, next_piece, sep: str, tries: int = 64):
    """Appends `next_piece()` to `pieces` while the running token count (each piece and a
    separator) stays within budget, skipping pieces too long for what is left (up to `tries` in
    a row)."""
    sep_cost = costs.piece("x" + sep + "x") - 2 * costs.piece("x")
    used, misses = sum(costs.piece(p) + sep_cost for p in pieces), 0
    while misses < tries:
        piece = next_piece()
        cost = costs.piece(piece) + sep_cost
        if used + cost > budget:
            misses += 1
            continue
        pieces.append(piece)
        used, misses = used + cost, 0
    return pieces


def _at(pieces: list[str], depth: float, costs) -> int:
    """The index to insert at so that the tokens before it are nearest `depth` of all."""
    ends = np.cumsum([0] + [costs.piece(p) + 1 for p in pieces])
    return int(np.argmin(np.abs(ends - depth * ends[-1])))


def _shrink(content_of, pieces: list[str], length: int, costs) -> str:
    """The content with filler pieces dropped until the prompt fits `length` (the pieces' sum
    can be off by a token or two from the tokenized whole): each time the smallest piece that
    covers the overflow, so the prompt stays as close to `length` as it can."""
    pieces = list(pieces)
    while pieces and (over := costs.prompt(content_of(pieces)) - length) > 0:
        sizes = [costs.piece(p) for p in pieces]
        enough = [i for i, size in enumerate(sizes) if size >= over]
        drop = min(enough, key=sizes.__getitem__) if enough else int(np.argmax(sizes))
        pieces.pop(drop)
    return content_of(pieces)


def _haystack(rng, paragraphs, costs, kind, length, depth, needles, key_chars, value_digits):
    count = needles if kind == "multi_needle" else 1
    keys = [_word(rng, key_chars) for _ in range(count)]
    values = [_number(rng, value_digits) for _ in range(count)]
    facts = [_needle(k, v) for k, v in zip(keys, values, strict=True)]
    if count == 1:
        question = f"What is the special magic number for {keys[0]}? Answer with the number only."
        answer = values[0]
    else:
        question = (
            f"What are the special magic numbers for {', '.join(keys)}? Answer with the "
            "numbers only, in that order, separated by commas."
        )
        answer = ", ".join(values)
    fixed = costs.prompt(question) + sum(costs.piece(f) + 1 for f in facts) + 2
    order = iter(rng.permutation(len(paragraphs)).tolist() * 1000)
    filler = _fill([], max(length - fixed, 0), costs, lambda: paragraphs[next(order)], "\n\n")
    # The asked fact at `depth`; the others (multi_needle) spread evenly around the haystack.
    spots = [depth] + [((depth + (i + 1) / count) % 1.0) for i in range(count - 1)]

    def content_of(filler):
        pieces = list(filler)
        for fact, spot in sorted(zip(facts, spots, strict=True), key=lambda x: -x[1]):
            pieces.insert(_at(filler, spot, costs), fact)
        return "\n\n".join(pieces) + "\n\n" + question

    content = _shrink(content_of, filler, length, costs)
    return _record(content, answer, kind, length, depth, costs)


def _kv(rng, paragraphs, costs, kind, length, depth, needles, key_chars, value_digits):
    del paragraphs, needles
    question_of = lambda key: f"What is the value of {key}? Answer with the value only."  # noqa: E731
    seen = set()

    def pair():
        key = _word(rng, key_chars)
        while key in seen:
            key = _word(rng, key_chars)
        seen.add(key)
        return f"{key}: {_number(rng, value_digits)}"

    asked = pair()
    fixed = costs.prompt(question_of(asked.split(":")[0])) + costs.piece(asked) + 2
    others = _fill([], max(length - fixed, 0), costs, pair, "\n")
    key, value = asked.split(": ")

    def content_of(others):
        lines = list(others)
        lines.insert(_at(others, depth, costs), asked)
        return "\n".join(lines) + "\n\n" + question_of(key)

    content = _shrink(content_of, others, length, costs)
    return _record(content, value, kind, length, depth, costs)
