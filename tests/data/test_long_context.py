"""The long-context task generator: prompt lengths at (and never over) their targets in the
model's tokens, the asked fact at its depth and nowhere else, answers that follow from the
context, and the records' two shapes (SFT messages, prompt + answer)."""

import json
import os
import re

import numpy as np
import pytest

from posttrain.data import (
    DataConfig,
    SourceConfig,
    load_tokenizer,
    long_context_records,
    make_pipeline,
    read_paragraphs,
)
from posttrain.demo import ASSETS_DIR

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(ASSETS_DIR / "tokenizer"))


WORDS = (
    "the a river stone cloud paper light garden window music table ocean forest reads writes "
    "carries under over near slowly quietly bright old new long small city road"
).split()


@pytest.fixture(scope="module")
def paragraphs(tmp_path_factory):
    """A seeded haystack: 300 paragraphs of 1 to 3 sentences (a fixed corpus, so the lengths
    the generator reaches do not move when the repository's docs change)."""
    rng = np.random.RandomState(0)
    sentence = lambda: " ".join(rng.choice(WORDS, rng.randint(4, 9))).capitalize() + "."  # noqa: E731
    text = "\n\n".join(" ".join(sentence() for _ in range(rng.randint(1, 4))) for _ in range(300))
    path = tmp_path_factory.mktemp("haystack") / "haystack.txt"
    path.write_text(text)
    return read_paragraphs([str(path)])


def _prompt_tokens(tok, record):
    return len(tok.apply_chat_template(record["prompt"], add_generation_prompt=True))


@pytest.mark.parametrize("kind", ["needle", "multi_needle", "kv"])
def test_records_hit_their_length_and_depth(tok, paragraphs, kind):
    lengths, depths = (256, 1024), (0.0, 0.5, 1.0)
    records = long_context_records(
        paragraphs, tok, kind=kind, lengths=lengths, depths=depths, per_cell=3, seed=1
    )
    assert len(records) == len(lengths) * len(depths) * 3
    for r in records:
        content = r["prompt"][0]["content"]
        assert r["messages"] == [*r["prompt"], {"role": "assistant", "content": r["answer"]}]
        assert r["domain"] == "long_context" and r["kind"] == kind
        tokens = _prompt_tokens(tok, r)
        assert tokens == r["length"] <= r["target_length"]
        assert tokens >= 0.9 * r["target_length"], (tokens, r["target_length"])
        context, question = content.rsplit("\n\n", 1)
        if kind == "kv":
            key = re.search(r"value of (\w+)\?", question).group(1)
            lines = context.split("\n")
            pairs = dict(line.split(": ") for line in lines)
            assert len(pairs) == len(lines)  # keys are unique
            assert pairs[key] == r["answer"]
            asked = f"{key}: {r['answer']}"
        else:
            keys = re.search(r"numbers? for (.+)\? Answer", question).group(1).split(", ")
            values = r["answer"].split(", ")
            assert len(keys) == len(values) == (3 if kind == "multi_needle" else 1)
            for k, v in zip(keys, values, strict=True):
                fact = f"The special magic number for {k} is {v}."
                assert context.count(fact) == 1 and context.count(k) == 1
            asked = f"The special magic number for {keys[0]} is {values[0]}."
        # Where the fact starts, as a share of the context's characters (the generator places
        # it by tokens, between whole paragraphs: 256 tokens hold too few of them to tell).
        where = context.index(asked) / (len(context) - len(asked))
        if kind == "kv" or r["target_length"] >= 1024:
            assert abs(where - r["depth"]) <= 0.2, (where, r["depth"])


def test_records_are_seeded(tok, paragraphs):
    make = lambda seed: long_context_records(  # noqa: E731
        paragraphs, tok, lengths=(300,), depths=(0.5,), per_cell=2, seed=seed
    )
    assert make(3) == make(3) and make(3) != make(4)


def test_bad_arguments_are_clear(tok, paragraphs, tmp_path):
    with pytest.raises(ValueError, match="kind='haystack'"):
        long_context_records(paragraphs, tok, kind="haystack")
    with pytest.raises(ValueError, match=r"depths must lie in \[0, 1\]"):
        long_context_records(paragraphs, tok, depths=(1.5,))
    with pytest.raises(ValueError, match="needs haystack paragraphs"):
        long_context_records([], tok, kind="needle")
    with pytest.raises(FileNotFoundError, match="no haystack file"):
        read_paragraphs([str(tmp_path / "*.txt")])


@pytest.mark.parametrize("mix_by", ["records", "tokens"])
def test_mixing_by_tokens_keeps_the_long_sources_share(tok, tmp_path, mix_by):
    """Short arithmetic examples (~20 tokens) and long key-value ones (~200) at weights 0.7 /
    0.3: by records the long source fills most of the packed rows' tokens; by tokens it fills
    its 30%."""
    records = long_context_records([], tok, kind="kv", lengths=(200,), depths=(0.5,), per_cell=64)
    long_path = tmp_path / "long.jsonl"
    long_path.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in records))
    sources = (
        SourceConfig(str(ASSETS_DIR / "train.jsonl"), weight=0.7, domain="short"),
        SourceConfig(str(long_path), weight=0.3, domain="long"),
    )
    config = DataConfig(sources, max_len=256, batch_size=16, mix_by=mix_by, read_threads=0)
    data = make_pipeline(config, tok, process_index=0, process_count=1)
    domain_ids = np.concatenate([next(data)["domain_ids"].ravel() for _ in range(40)])
    data.close()
    long_share = (domain_ids == data.domains.index("long")).sum() / (domain_ids >= 0).sum()
    if mix_by == "tokens":
        assert abs(long_share - 0.3) < 0.06, long_share
    else:
        assert long_share > 0.7, long_share
