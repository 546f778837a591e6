"""The `retrieval` environment: questions about documents longer than the window, answered by
searching a corpus and reading only what is needed.

Tools: `search(query, k=3)` ranks the index's passages by BM25 and shows each as
`[doc_id#span] text`; `open(doc_id, span)` shows one passage whole. The index is a
`posttrain data index` folder (`posttrain.data.build_index`), named by the record's "index" (or
the environment's `index` option) and loaded once per process. The first turn without a tool
call is the answer, scored by the record's reward domain (`grounded_qa`: answer F1 and the
citations found verbatim in the record's "document").

`long_document_tasks(n_docs, seed)` makes such a corpus: registries of fictional towns (where
each lies, when it was founded, its mayor, what it exports; about 1,300 words a document) and a
question about each fact, with its answer and evidence sentence.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

from posttrain.envs._base import Tool, ToolEnvironment, register_env

RETRIEVAL_SYSTEM = (
    "Answer questions about documents too long to read whole. search(query) finds passages; "
    "open(doc_id, span) reads one. Then answer with a line 'Answer: ...' and quote your "
    "evidence in <cite></cite>."
)
_SYLLABLES = ("ar", "bel", "cor", "dun", "el", "fen", "gor", "hal", "is", "kel", "lor", "mar",
              "nor", "or", "pel", "quin", "ros", "sel", "tor", "ul", "ven", "wyn")  # fmt: skip
_GOODS = ("wool", "salt", "timber", "copper", "cheese", "glass", "honey", "rope", "tin", "wine",
          "linen", "pottery", "barley", "amber", "leather", "paper")  # fmt: skip
_FACTS = {  # attribute: (sentence, question), with {town} and {value}
    "river": ("{town} lies on the river {value}.", "Which river does {town} lie on?"),
    "founded": ("{town} was founded in {value}.", "In which year was {town} founded?"),
    "mayor": ("The mayor of {town} is {value}.", "Who is the mayor of {town}?"),
    "export": ("{town} mostly exports {value}.", "What does {town} mostly export?"),
}
_FILLER = (
    "Travellers often stop there on the way to the coast.",
    "The market opens early on most days of the week.",
    "Its old bridge was rebuilt after a flood long ago.",
    "Visitors remark on the narrow streets and the quiet squares.",
)


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


def long_document_tasks(n_docs: int, seed: int = 0, *, towns: int = 24) -> tuple[list, list]:
    """(documents [{"id", "text"}], questions [{"question", "answer", "doc_id", "evidence"}]):
    `n_docs` registries of `towns` towns each, a question per fact (four per town)."""
    rng = random.Random(seed)
    documents, questions, used = [], [], set()
    for d in range(n_docs):
        doc_id = f"registry-{seed}-{d}"
        sentences = [f"The registry of the {_name(rng, 2)} province lists its towns."]
        for _ in range(towns):
            town = _name(rng, 3)
            while town in used:
                town = _name(rng, 3)
            used.add(town)
            values = {
                "river": _name(rng, 2),
                "founded": str(rng.randint(1100, 1900)),
                "mayor": f"{_name(rng, 2)} {_name(rng, 2)}",
                "export": rng.choice(_GOODS),
            }
            for attribute in rng.sample(list(_FACTS), len(_FACTS)):
                sentence, question = _FACTS[attribute]
                evidence = sentence.format(town=town, value=values[attribute])
                sentences.append(evidence)
                questions.append({"question": question.format(town=town),
                                  "answer": values[attribute], "doc_id": doc_id,
                                  "evidence": evidence})  # fmt: skip
            sentences.append(rng.choice(_FILLER))
        documents.append({"id": doc_id, "text": " ".join(sentences)})
    return documents, questions


def retrieval_records(questions, documents, index: str, domain: str = "grounded_qa") -> list:
    """Records of the `retrieval` environment: the question alone as the prompt, the index to
    search, and the document for the reward's citations."""
    text = {d["id"]: d["text"] for d in documents}
    return [{"prompt": q["question"], "index": index, "document": text[q["doc_id"]],
             "answer": q["answer"], "domain": domain} for q in questions]  # fmt: skip


def context_records(questions, documents, domain: str = "grounded_qa") -> list:
    """The same questions with their whole document in the prompt (what truncation or
    `rollout.fit_documents` must cut to fit a window)."""
    text = {d["id"]: d["text"] for d in documents}
    return [{"prompt": f"{text[q['doc_id']]}\n\nQuestion: {q['question']}",
             "document": text[q["doc_id"]], "answer": q["answer"], "domain": domain}
            for q in questions]  # fmt: skip


class RetrievalEnvironment(ToolEnvironment):
    """A retrieval episode (module docstring)."""

    def __init__(self, record: Mapping[str, Any], *, index: str = "", k_max: int = 8,
                 system: str = RETRIEVAL_SYSTEM):  # fmt: skip
        from posttrain.data import RetrievalIndex

        path = str(record.get("index") or index)
        if not path:
            raise ValueError(
                "a retrieval record needs 'index' (a `posttrain data index` folder), or set "
                "the environment's index option"
            )
        self.index = RetrievalIndex.load(path)

        def search(query: str, k: int = 3) -> str:
            """Finds the passages that best match a query.

            Args:
                query: words to look for.
                k: how many passages to show (at most 8).
            """
            found = self.index.search(query, min(max(int(k), 1), k_max))
            if not found:
                return "No passage matches; try other words."
            return "\n".join(f"[{p['doc_id']}#{p['span']}] {p['text']}" for p in found)

        def open(doc_id: str, span: int) -> str:  # noqa: A001 (the tool's name)
            """Reads one passage whole.

            Args:
                doc_id: the document, as search shows it before '#'.
                span: the passage's number, as search shows it after '#'.
            """
            passage = self.index.open(doc_id, span)
            if passage is None:
                raise ValueError(f"there is no passage {doc_id}#{span}; search first")
            return passage["text"]

        super().__init__(record, [Tool(search), Tool(open)], system)


def retrieval_env(record: Mapping[str, Any], **options: Any) -> RetrievalEnvironment:
    return RetrievalEnvironment(record, **options)


def cited_answer(question: dict, text: str) -> str:
    """What a reader of `text` answers (the scripted policies of tests and docs): the evidence
    sentence quoted and its answer when `text` holds it, else "unknown"."""
    if question["evidence"] in re.sub(r"\s+", " ", text):
        return f"<cite>{question['evidence']}</cite>\nAnswer: {question['answer']}"
    return "Answer: unknown"


register_env("retrieval", retrieval_env)
