"""Record text, normalised, and its word n-grams as 64-bit hashes: what `dedup` and
`decontaminate` compare.

Normalisation is NFKC, case folding and whitespace collapsed to single spaces, so records that
differ only in those compare equal. Hashing is vectorised over a whole chunk of records with
NumPy (a per-word `hashlib` call would cost more than the rest of the MinHash): the chunk's
normalised text is one byte array, a word's hash is a polynomial over its bytes taken from a
prefix sum (mod 2**64), and an n-gram's hash combines its words' hashes with per-position
constants. A 64-bit finaliser (splitmix64) spreads the bits. Hashes are fixed functions of the
text: the same on every machine, process and run.
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

_BASE = 0x100000001B3  # the polynomial's base (odd, so invertible mod 2**64)
_BASE_INV = pow(_BASE, -1, 1 << 64)
_MAX_N = 64  # the longest n-gram (shingle) `ngram_hashes` takes
_WORD = re.compile(r"\w+")

# Fields holding a record's content, in the order they enter its text (docs/data.md).
CONTENT_FIELDS = ("messages", "prompt", "completion", "chosen", "rejected", "text")


def normalize(text: str) -> str:
    """NFKC, case-folded, whitespace runs collapsed to one space, no leading/trailing space."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def words_only(text: str) -> str:
    """`normalize(text)` with punctuation dropped: its `\\w+` words joined by single spaces."""
    return " ".join(_WORD.findall(normalize(text)))


def record_text(record: Mapping[str, Any]) -> str:
    """A record's content as one text: each of `CONTENT_FIELDS` it has, as "label: text" lines
    (a string field labelled with its key; messages each with their role, their text parts and
    tool calls as sorted JSON). A record with none of those fields (an eval set's
    {"question", "answer"}) gives its top-level string fields, sorted by key. Metadata (ids,
    domains, sources) is left out, so copies under other ids still compare equal."""
    lines: list[str] = []
    for key in CONTENT_FIELDS:
        value = record.get(key)
        if isinstance(value, str):
            lines.append(f"{key}: {value}")
        elif isinstance(value, list):
            lines += [f"{role}: {text}" for role, text in _messages(value, key)]
    if not lines and not any(k in record for k in CONTENT_FIELDS):
        lines = [f"{k}: {v}" for k, v in sorted(record.items()) if isinstance(v, str)]
    return "\n".join(lines)


def _messages(messages: list, default_role: str) -> list[tuple[str, str]]:
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            out.append((default_role, str(m)))
            continue
        content = m.get("content")
        if isinstance(content, list):  # multimodal parts: their text only
            content = " ".join(
                p["text"]
                for p in content
                if isinstance(p, Mapping) and isinstance(p.get("text"), str)
            )
        text = content if isinstance(content, str) else ""
        if m.get("tool_calls"):
            text += " " + json.dumps(m["tool_calls"], sort_keys=True, ensure_ascii=False)
        out.append((str(m.get("role", default_role)), text))
    return out


def all_strings(value: Any) -> list[str]:
    """Every string inside a JSON value (dict values, list items, at any depth; not keys)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [s for v in value for s in all_strings(v)]
    return []


@functools.lru_cache(maxsize=4)
def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """BASE**j and BASE**-j mod 2**64 for j < n (n rounded up to a power of two by callers)."""
    pw = np.empty(n, np.uint64)
    ipw = np.empty(n, np.uint64)
    pw[0] = ipw[0] = 1
    np.cumprod(np.full(n - 1, _BASE, np.uint64), out=pw[1:])
    np.cumprod(np.full(n - 1, _BASE_INV, np.uint64), out=ipw[1:])
    return pw, ipw


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (a bijection that spreads every bit)."""
    x = x ^ (x >> np.uint64(30))
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def word_hashes(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """64-bit hashes of the space-separated words of already-normalised texts.

    Args:
      texts: strings whose words are separated by single spaces, none leading or trailing
        (what `normalize` and `words_only` return).

    Returns:
      (hashes uint64 [total words], counts int64 [len(texts)]): every text's word hashes in
      order, one text after another, and how many words each text has.
    """
    counts = np.fromiter((t.count(" ") + 1 if t else 0 for t in texts), np.int64, len(texts))
    buf = np.frombuffer(" ".join(t for t in texts if t).encode("utf-8"), np.uint8)
    if not len(buf):
        return np.zeros(0, np.uint64), counts
    size = 1 << int(len(buf) + 1).bit_length()
    pw, ipw = _powers(size)
    prefix = np.zeros(len(buf) + 1, np.uint64)
    terms = np.multiply(buf, pw[: len(buf)], dtype=np.uint64)
    terms += pw[: len(buf)]  # (byte + 1) * BASE**position: a NUL byte still counts
    np.cumsum(terms, out=prefix[1:])
    spaces = np.flatnonzero(buf == 32)
    starts = np.concatenate(([0], spaces + 1))
    ends = np.concatenate((spaces, [len(buf)]))
    # sum over the word's bytes of (byte + 1) * BASE**(position in the word)
    return mix64((prefix[ends] - prefix[starts]) * ipw[starts]), counts


@functools.cache
def position_constants(n: int) -> np.ndarray:
    """n fixed odd uint64 constants (the same in every process), one per n-gram position."""
    rng = np.random.default_rng(0x5EED)
    return np.frombuffer(rng.bytes(8 * n), "<u8") | np.uint64(1)


def ngram_hashes(
    words: np.ndarray, counts: np.ndarray, n: int, *, short: bool
) -> tuple[np.ndarray, np.ndarray]:
    """64-bit hashes of every run of `n` consecutive words inside each text (never across two).

    Args:
      words: word hashes from `word_hashes`.
      counts: words per text, from `word_hashes`.
      n: words per n-gram (1 to 64).
      short: a text with fewer than `n` (but some) words gives one hash of all its words
        (shingles for MinHash, so short records still compare); else it gives none (n-grams
        for decontamination, where only a full n-gram counts as shared).

    Returns:
      (hashes uint64 [total n-grams], counts int64 [len(counts)]): per text in order.
    """
    if not 1 <= n <= _MAX_N:
        raise ValueError(f"n-gram length must be 1 to {_MAX_N} words, got {n}")
    total = len(words)
    ends = np.repeat(np.cumsum(counts), counts)  # one past each word's text
    at = np.arange(total)
    acc = np.zeros(total, np.uint64)
    for k, constant in enumerate(position_constants(n)):
        inside = at + k < ends
        acc += np.where(inside, words[np.minimum(at + k, total - 1)], np.uint64(0)) * constant
    valid = at + n <= ends
    per_text = np.maximum(counts - n + 1, 0)
    if short:
        first = at == ends - np.repeat(counts, counts)
        valid |= first & (np.repeat(counts, counts) < n)
        per_text = np.where(counts > 0, np.maximum(per_text, 1), 0)
    return mix64(acc[valid]), per_text
