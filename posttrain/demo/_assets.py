"""The demo's files: a 512-token byte-level BPE tokenizer with a ChatML template, and the task's
train and held-out JSONL sets. The copies under `ASSETS_DIR` ship in the repository; regenerate
them with `python -m posttrain.demo._assets` (a second, single core, same bytes every time).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path

from posttrain.demo._task import make_dataset

ASSETS_DIR = Path(__file__).parent / "assets"
# Plain English beside the task's text, so the merges also cover ordinary words; it must offer
# enough distinct pairs for the trainer to reach its vocabulary size.
_ENGLISH = """\
You are a helpful assistant. Answer the question with a single number and nothing else.
The user asks a question and the assistant answers it briefly and precisely.
What is the sum of these two numbers? What is the difference between them?
Add the numbers digit by digit from the right, and carry one when a column is ten or more.
To subtract, borrow from the next column; when the second number is larger the result is negative.
Addition and subtraction are the first operations that children learn at school.
A positive number is greater than zero, and a negative number is less than zero.
The answer is correct only if every digit matches and the sign is right.
Post-training teaches a small language model to follow instructions and to reason.
Supervised fine-tuning computes the loss on the tokens of the assistant only.
Direct preference optimisation compares a chosen answer with a rejected one.
Reinforcement learning samples several completions and rewards the ones a verifier accepts.
The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire.
Hello there! How are you doing today? I am fine, thank you, and how about you?
The weather is sunny with a light breeze in the afternoon and rain later in the evening.
Please write your working first, then state the final result on its own line.
Numbers such as one, two, three, four, five, six, seven, eight, nine and ten are small.
A hundred and a thousand are larger; a million is much larger than both of them.
This model was trained from scratch on a single processor in a few minutes.
Check the result again: mistakes in one column change every column to its left.
"""
_PROBLEMS_SEED = 1234  # the problems the tokenizer trains on (its merges barely depend on them)


def build_tokenizer(
    out_dir: str | Path, *, texts: Iterable[str] | None = None, chat_template: str | None = None
) -> str:
    """Trains the demo tokenizer and writes it as a Hugging Face tokenizer directory.

    `posttrain.curate.train_tokenizer`: byte-level BPE with exactly 512 entries (the special
    tokens, the 256 bytes, merges learnt on the task's questions and answers plus some
    English), digits always single tokens, so "936" is 9, 3, 6.

    Args:
      out_dir: the directory to write tokenizer.json and tokenizer_config.json into.
      texts: what the merges are learnt on (default: the arithmetic task and the English).
      chat_template: the chat template to ship (default: ChatML, `CHATML_TEMPLATE`).

    Returns:
      The directory, for `posttrain.data.load_tokenizer` or `AutoTokenizer.from_pretrained`.
    """
    from posttrain.curate import CHATML_TEMPLATE, train_tokenizer  # (curate brings JAX along)

    template = CHATML_TEMPLATE if chat_template is None else chat_template
    texts = _training_text() if texts is None else texts
    return train_tokenizer(out_dir, texts, chat_template=template)


def build_assets(
    out_dir: str | Path,
    *,
    n_train: int = 12_000,
    n_eval: int = 500,
    seed: int = 0,
    max_digits: int = 2,
) -> dict[str, str]:
    """Writes the tokenizer and the task's datasets; the same bytes for the same arguments.

    The held-out set is drawn first (with `seed`), so it stays the same when `n_train` changes;
    the training set (drawn with `seed + 1`) excludes every one of its problems.

    Args:
      out_dir: the directory to write tokenizer/, train.jsonl and eval.jsonl into.
      n_train: the number of training problems.
      n_eval: the number of held-out problems.
      seed: seeds both draws.
      max_digits: the most digits an operand has.

    Returns:
      {"tokenizer": dir, "train": path, "eval": path}.
    """
    out = Path(out_dir)
    held_out = make_dataset(n_eval, seed, max_digits=max_digits)
    train = make_dataset(n_train, seed + 1, max_digits=max_digits, exclude=held_out)
    paths = {"tokenizer": build_tokenizer(out / "tokenizer")}
    for name, records in (("train", train), ("eval", held_out)):
        paths[name] = str(out / f"{name}.jsonl")
        lines = (json.dumps(record, separators=(",", ":")) for record in records)
        _write_text(Path(paths[name]), "\n".join(lines))
    return paths


def _training_text() -> list[str]:
    """The tokenizer's training text: English, and the task's chats (roles, questions, answers)."""
    chats = make_dataset(2_000, _PROBLEMS_SEED)
    turns = (text for chat in chats for m in chat["messages"] for text in (m["role"], m["content"]))
    return [*_ENGLISH.splitlines(), "system", *turns]


def _write_text(path: Path, text: str) -> None:
    """Writes UTF-8 text with "\\n" line ends and a final newline, whatever the platform."""
    path.write_bytes((text + "\n").encode("utf-8"))


def main(argv: list[str]) -> None:
    """`python -m posttrain.demo._assets [OUT_DIR]`: regenerates the shipped assets."""
    paths = build_assets(argv[1] if len(argv) > 1 else ASSETS_DIR)
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main(sys.argv)
