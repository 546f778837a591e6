"""A BM25 index over a corpus's passages (`bm25s`), built once beside the data and reused, and
relevance-based truncation of a document to a token budget.

`build_index(inputs, out)` reads documents (records with "id" and "text": JSON lines, Parquet,
a dataset folder, as any data source), cuts each into passages of about `passage_words` words,
and writes `<out>/`: `passages.jsonl` ({"doc_id", "span", "text"}: span is the passage's number
in its document), `documents.jsonl`, `bm25/` (the `bm25s` index) and `index.json` (the inputs'
hashes and the settings). Run again on the same inputs with the same settings, it rebuilds
nothing; on others it refuses unless told to overwrite. `RetrievalIndex.load(out)` reads it
back (once per process and folder); `search(query, k)` ranks passages, `open(doc_id, span)`
returns one.

`fit_document(question, document, count_tokens, max_tokens)` keeps what fits of a document in a
budget: its passages most relevant to the question, in document order, for a prompt whose
document is longer than the window (dynamic truncation).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from posttrain.data._formats import decode
from posttrain.data._sources import Records

INDEX_VERSION = 1
PASSAGE_WORDS = 120


def passages_of(text: str, words: int = PASSAGE_WORDS) -> list[str]:
    """`text` cut into passages of about `words` words, at sentence ends where one falls in the
    second half of a passage (never mid-word)."""
    tokens = re.findall(r"\S+\s*", text)
    out, start = [], 0
    while start < len(tokens):
        end = min(start + words, len(tokens))
        if end < len(tokens):
            for cut in range(end, start + words // 2, -1):
                if re.search(r"[.!?][\"')\]]?\s*$", tokens[cut - 1]):
                    end = cut
                    break
        out.append("".join(tokens[start:end]).strip())
        start = end
    return [p for p in out if p]


def _tokenize(texts: Sequence[str]):
    import bm25s

    return bm25s.tokenize(list(texts), stopwords="en", show_progress=False)


def build_index(inputs: Sequence[str], out: str | os.PathLike, *,
                passage_words: int = PASSAGE_WORDS, overwrite: bool = False) -> dict:  # fmt: skip
    """Builds (or finds up to date) the index of `inputs`' documents in `out`.

    Returns:
      index.json's dict, with "status": "built" or "reused".

    Raises:
      ValueError: a record without a string "text" or with a duplicate "id"; or `out` holds an
        index of other inputs or settings and `overwrite` is False.
      ImportError: bm25s is not installed (the message says how to install it).
    """
    try:
        import bm25s
    except ImportError:
        raise ImportError(
            "the retrieval index needs bm25s: pip install 'posttrain[retrieval]'"
        ) from None
    sources = [Records(p) for p in inputs]
    identity = {
        "version": INDEX_VERSION,
        "passage_words": passage_words,
        "inputs": [f for r in sources for f in r.describe()],
    }
    out = Path(out)
    meta_path = out / "index.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if {k: meta.get(k) for k in identity} == identity:
            return {**meta, "status": "reused"}
        if not overwrite:
            raise ValueError(
                f"{out} holds an index of other inputs or settings; pass overwrite=True "
                "(--overwrite) to replace it, or build into another folder"
            )
    documents, seen = [], set()
    for records in sources:
        for i in range(len(records)):
            raw, where = records[i]
            record = decode(raw)
            text, doc_id = record.get("text"), str(record.get("id", f"doc{len(documents)}"))
            if not isinstance(text, str):
                raise ValueError(f"{where}: a document needs a string 'text'")
            if doc_id in seen:
                raise ValueError(f"{where}: document id {doc_id!r} appears twice")
            seen.add(doc_id)
            documents.append({"id": doc_id, "text": text})
    passages = [
        {"doc_id": d["id"], "span": i, "text": p}
        for d in documents
        for i, p in enumerate(passages_of(d["text"], passage_words))
    ]
    if not passages:
        raise ValueError(f"the inputs {list(inputs)} hold no text to index")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".index-", dir=out.parent))
    try:
        retriever = bm25s.BM25()
        retriever.index(_tokenize([p["text"] for p in passages]), show_progress=False)
        retriever.save(str(staging / "bm25"))
        for name, rows in (("passages", passages), ("documents", documents)):
            with open(staging / f"{name}.jsonl", "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
        meta = {**identity, "id": digest[:16], "documents": len(documents),
                "passages": len(passages)}  # fmt: skip
        (staging / "index.json").write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {**meta, "status": "built"}


class RetrievalIndex:
    """A built index, read back (`load`)."""

    def __init__(self, path: str | os.PathLike):
        import bm25s

        path = Path(path)
        if not (path / "index.json").is_file():
            raise FileNotFoundError(
                f"{path} holds no retrieval index; build one with `posttrain data index "
                f"--input=<documents> --out={path}`"
            )
        self.path, self.meta = path, json.loads((path / "index.json").read_text())
        self._bm25 = bm25s.BM25.load(str(path / "bm25"))
        with open(path / "passages.jsonl", encoding="utf-8") as f:
            self.passages = [json.loads(line) for line in f]
        self._at = {(p["doc_id"], p["span"]): i for i, p in enumerate(self.passages)}

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def load(path: str) -> RetrievalIndex:
        """The index in `path`, read once per process."""
        return RetrievalIndex(path)

    def search(self, query: str, k: int = 3) -> list[dict]:
        """The `k` passages that best match `query`, best first, each with its "score"."""
        k = max(1, min(int(k), len(self.passages)))
        found = self._bm25.retrieve(_tokenize([query]), k=k, show_progress=False)
        out = []
        for i, score in zip(found.documents[0], found.scores[0], strict=True):
            if score > 0:
                out.append({**self.passages[int(i)], "score": float(score)})
        return out

    def open(self, doc_id: str, span: int) -> dict | None:
        """Passage `span` of document `doc_id`, or None if there is none."""
        i = self._at.get((str(doc_id), int(span)))
        return None if i is None else self.passages[i]


_JOIN = " ... "


def fit_document(question: str, document: str, count_tokens: Callable[[str], int],
                 max_tokens: int, *, passage_words: int = 60) -> str:  # fmt: skip
    """What fits of `document` in `max_tokens` (as `count_tokens` counts): the whole document if
    it fits, else its passages most relevant to `question` (BM25 over the document's passages),
    as many as fit, in document order, joined by " ... ". Empty when not even one fits.

    Each passage and the joint are counted once and summed; a join may tokenize a little
    differently, which `fit_prompt` checks on the whole prompt."""
    if count_tokens(document) <= max_tokens:
        return document
    return _fit(_ranked(question, document, passage_words, count_tokens), max_tokens)


def _ranked(question: str, document: str, passage_words: int, count_tokens) -> list:
    """(passages, their indices most relevant first, their token counts, the joint's)."""
    import bm25s

    passages = passages_of(document, passage_words)
    retriever = bm25s.BM25()
    retriever.index(_tokenize(passages), show_progress=False)
    found = retriever.retrieve(_tokenize([question]), k=len(passages), show_progress=False)
    order = [int(j) for j in found.documents[0]]
    return [passages, order, [count_tokens(p) for p in passages], count_tokens(_JOIN)]


def _fit(ranked: list, max_tokens: int) -> str:
    passages, order, sizes, joint = ranked
    kept, used = [], 0
    for i in order:  # the most relevant first; any later one that still fits too
        extra = sizes[i] + (joint if kept else 0)
        if used + extra <= max_tokens:
            kept.append(i)
            used += extra
    return _JOIN.join(passages[j] for j in sorted(kept))


def fit_prompt(record: dict, tokenizer, max_tokens: int) -> dict | None:
    """`record` with its "document" (which its prompt must hold verbatim) cut down by
    `fit_document` so that the encoded prompt fits `max_tokens`; None when the record has no
    such document or even the question alone does not fit."""
    from posttrain.data._formats import encode_prompt

    document = record.get("document")
    prompt = record.get("prompt")
    if not isinstance(document, str) or not document:
        return None
    if isinstance(prompt, str):
        holders = [None] if document in prompt else []
    elif isinstance(prompt, list):
        holders = [i for i, m in enumerate(prompt) if document in str(m.get("content", ""))]
    else:
        holders = []
    if not holders:
        return None

    def with_document(text: str) -> dict:
        if holders[0] is None:
            return {**record, "prompt": prompt.replace(document, text)}
        messages = [dict(m) for m in prompt]
        messages[holders[0]]["content"] = messages[holders[0]]["content"].replace(document, text)
        return {**record, "prompt": messages}

    rest = len(encode_prompt(with_document(""), tokenizer))
    budget = max_tokens - rest
    if budget <= 0:
        return None
    asked = with_document("")["prompt"]  # what the prompt says beside the document
    question = asked if isinstance(asked, str) else " ".join(str(m["content"]) for m in asked)
    count = lambda text: len(tokenizer.encode(text))  # noqa: E731
    ranked = _ranked(question, document, 60, count)  # (ranked and counted once)
    while budget > 0:  # (a join can merge tokens differently: shrink until it fits)
        fitted = with_document(_fit(ranked, budget))
        if len(encode_prompt(fitted, tokenizer)) <= max_tokens:
            return fitted
        budget -= 8
    return None
