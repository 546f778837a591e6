"""A synthetic visual task a tiny vision-language model learns in a minute on a CPU: how many
shapes an image holds, and what colour they are.

Each image is a white square with 1-4 filled circles or squares of one colour (red, green or
blue), each in its own cell of a 4 x 4 grid; the questions are "How many shapes are there?"
(answer "1".."4") and "What colour are the shapes?" (answer the colour word). `write_task`
writes the images as PNG files, SFT chats and RL prompts that name them by relative path, and
a word-level tokenizer whose vocabulary is exactly the task's words plus the image token
`<image>` (id 3); the LLaVA-style `posttrain.models` preset "tiny_vlm" is sized for it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import PIL.Image
import PIL.ImageDraw
from tokenizers import Tokenizer, models, pre_tokenizers

from posttrain.data import (
    encode_prompt,
    flatten_record,
    load_pixels,
    load_tokenizer,
    prompt_image_spec,
)
from posttrain.sampling import generate

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220)}
QUESTIONS = {
    "count": "How many shapes are there?",
    "colour": "What colour are the shapes?",
}
ANSWERS = {"count": ("1", "2", "3", "4"), "colour": tuple(COLOURS)}
IMAGE_TOKEN = "<image>"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", IMAGE_TOKEN)
# The vocabulary after the special tokens: chat roles, the questions' words and the answers.
WORDS = (
    "system", "user", "assistant", "How", "many", "shapes", "are", "there", "?", "What",
    "colour", "the", "1", "2", "3", "4", *COLOURS,
)  # fmt: skip
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def draw_shapes(rng: np.random.Generator, *, size: int = 32) -> tuple[PIL.Image.Image, dict]:
    """A white `size` x `size` image with 1-4 shapes of one colour, each inside its own cell of
    a 4 x 4 grid (so none touch, and each sits in one 8 x 8 patch of a 32-pixel image).

    Returns:
      (image, facts): facts are {"count": int, "colour": str, "shape": "circle" | "square"}.
    """
    count = int(rng.integers(1, 5))
    colour = str(rng.choice(list(COLOURS)))
    shape = str(rng.choice(["circle", "square"]))
    image = PIL.Image.new("RGB", (size, size), (255, 255, 255))
    draw = PIL.ImageDraw.Draw(image)
    cell = size // 4
    for index in rng.choice(16, size=count, replace=False):
        r = int(rng.integers(max(1, cell // 3), max(2, cell // 2)))  # radius, within the cell
        x0, y0 = (int(index) % 4) * cell, (int(index) // 4) * cell
        x, y = (int(v) for v in np.array([x0, y0]) + r + rng.integers(0, cell - 2 * r, size=2))
        box = (x - r, y - r, x + r - 1, y + r - 1)
        if shape == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        else:
            draw.rectangle(box, fill=COLOURS[colour])
    return image, {"count": count, "colour": colour, "shape": shape}


def answer(facts: dict, question: str) -> str:
    """The answer to a question kind ("count" or "colour") about an image's facts."""
    return str(facts["count"]) if question == "count" else facts["colour"]


def build_tokenizer(out_dir: str | Path) -> str:
    """Writes the task's word-level tokenizer (tokenizer.json, tokenizer_config.json with a
    ChatML template; EOS `<|im_end|>`, pad `<|endoftext|>`) and returns its directory."""
    vocab = {t: i for i, t in enumerate(dict.fromkeys((*SPECIAL_TOKENS, *WORDS, "[UNK]")))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    # Words and "?" are pieces; whitespace (the template's newlines too) is dropped, and
    # decoding joins the pieces with a space: all the task's text needs.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split("?", "isolated")]
    )
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return str(out)


def write_task(
    out_dir: str | Path,
    *,
    n_train: int,
    n_eval: int,
    seed: int = 0,
    size: int = 32,
    questions: tuple[str, ...] = ("count", "colour"),
) -> dict[str, str]:
    """Writes the task: images/NNNNN.png, sft_train.jsonl and sft_eval.jsonl (chats: an image
    and a question, then the answer), dpo_train.jsonl and dpo_eval.jsonl (the same questions as
    preference pairs: the answer chosen, another one rejected), rl_prompts.jsonl (the training
    images' count questions as prompts with an "answer", domain "arithmetic": its integer
    verifier scores them) and tokenizer/. `questions`: the kinds asked in turn ("count",
    "colour"). The same arguments give the same bytes.

    Returns:
      {"tokenizer", "train", "eval", "pairs_train", "pairs_eval", "prompts", "images"}: paths.
    """
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng, pair_rng = np.random.default_rng(seed), np.random.default_rng([seed, 1])
    kinds = list(questions)
    records: dict[str, list[dict]] = {k: [] for k in ("train", "eval", "prompts", "pairs_train",
                                                      "pairs_eval")}  # fmt: skip
    for i in range(n_train + n_eval):
        image, facts = draw_shapes(rng, size=size)
        name = f"images/{i:05d}.png"
        image.save(out / name)
        split = "train" if i < n_train else "eval"
        kind = kinds[i % len(kinds)]
        picture = {"type": "image", "image": name}
        user = {"role": "user", "content": [picture, {"type": "text", "text": QUESTIONS[kind]}]}
        reply = {"role": "assistant", "content": answer(facts, kind)}
        records[split].append({"messages": [user, reply]})
        wrong = [a for a in (ANSWERS[kind]) if a != reply["content"]]
        rejected = str(pair_rng.choice(wrong))
        pair = {"prompt": [user], "chosen": reply["content"], "rejected": rejected}
        records[f"pairs_{split}"].append(pair)
        if split == "train":
            question = {"type": "text", "text": QUESTIONS["count"]}
            count_user = {"role": "user", "content": [picture, question]}
            records["prompts"].append(
                {"prompt": [count_user], "answer": str(facts["count"]), "domain": "arithmetic"}
            )
    files = {"train": "sft_train.jsonl", "eval": "sft_eval.jsonl", "prompts": "rl_prompts.jsonl",
             "pairs_train": "dpo_train.jsonl", "pairs_eval": "dpo_eval.jsonl"}  # fmt: skip
    for split, name in files.items():
        lines = (json.dumps(r, separators=(",", ":")) for r in records[split])
        (out / name).write_text("\n".join(lines) + "\n")
    paths = {split: str(out / name) for split, name in files.items()}
    return {"tokenizer": build_tokenizer(out / "tokenizer"), "images": str(out / "images"), **paths}


def greedy_accuracy(model, tokenizer_dir: str, path: str, *, limit: int | None = None) -> float:
    """The share of a chat file's questions (`write_task`'s sft_*.jsonl: an image and a
    question, then the answer) whose greedy answer, read with the images, is the answer."""
    return sampled_accuracy(model, tokenizer_dir, path, limit=limit, n=1, temperature=0.0)


def sampled_accuracy(
    model,
    tokenizer_dir: str,
    path: str,
    *,
    limit: int | None = None,
    n: int = 8,
    temperature: float = 1.0,
    seed: int = 0,
) -> float:
    """`greedy_accuracy` of `n` samples per question at `temperature` (drawn from `seed`): the
    share of all samples that answer right, what RL's sampled reward measures on these
    questions."""
    tokenizer = load_tokenizer(tokenizer_dir)
    spec = prompt_image_spec(model.config.vision, tokenizer, 64)
    prompts, images, answers = [], [], []
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()][:limit]
    for record in records:
        flat, refs = flatten_record({"prompt": record["messages"][:-1]}, spec, ("prompt",))
        prompts.append(encode_prompt(flat, tokenizer))
        images.append(list(load_pixels(refs, spec, str(Path(path).parent))))
        answers.append(record["messages"][-1]["content"])
    out = generate(model, tokenizer, prompts, max_new_tokens=3, images=images, n=n,
                   temperature=temperature, seed=seed)  # fmt: skip
    right = [(c.text.split() or [""])[0] == a for row, a in zip(out, answers, strict=True)
             for c in row]  # fmt: skip
    return float(np.mean(right))
