"""Retrieval over documents longer than the window: the BM25 index (`posttrain data index`) is
built once and reused, the `retrieval` environment's tools find and read the evidence, and a
reader given the retrieved passage or the dynamically truncated document (`fit_prompt`,
`rollout.fit_documents`) answers where one given the truncated document cannot."""

import json
import os

import numpy as np
import pytest

from posttrain.cli import main as cli
from posttrain.config import build
from posttrain.data import (
    DataConfig,
    RetrievalIndex,
    build_index,
    encode_prompt,
    fit_prompt,
    load_tokenizer,
)
from posttrain.demo import ASSETS_DIR
from posttrain.envs import (
    RETRIEVAL_SYSTEM,
    cited_answer,
    context_records,
    long_document_tasks,
    make_env,
    retrieval_records,
)
from posttrain.rewards import default_registry
from posttrain.rl._prompts import PromptData

WINDOW = 384  # tokens of the demo tokenizer: a registry takes ~1,900


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("retrieval")
    documents, questions = long_document_tasks(2, seed=0)
    (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in documents))
    assert cli(["data", "index", f"--input={root / 'docs.jsonl'}", f"--out={root / 'index'}"]) == 0
    tokenizer = load_tokenizer(ASSETS_DIR / "tokenizer")
    return {"root": root, "documents": documents, "questions": questions,
            "index": str(root / "index"), "tokenizer": tokenizer}  # fmt: skip


def test_the_index_is_built_once_and_reused(corpus, capsys):
    root, index = corpus["root"], corpus["index"]
    files = {p: os.stat(os.path.join(index, p)).st_mtime_ns for p in os.listdir(index)}
    assert cli(["data", "index", f"--input={root / 'docs.jsonl'}", f"--out={index}"]) == 0
    assert "reused" in capsys.readouterr().out
    assert {p: os.stat(os.path.join(index, p)).st_mtime_ns for p in os.listdir(index)} == files
    meta = json.loads((root / "index" / "index.json").read_text())
    assert meta["documents"] == 2 and meta["passages"] > 10
    # Other inputs: refused unless --overwrite, then built anew.
    (root / "more.jsonl").write_text(json.dumps({"id": "x", "text": "A river runs."}) + "\n")
    other = [f"--input={root / 'docs.jsonl'}", f"--input={root / 'more.jsonl'}"]
    assert cli(["data", "index", *other, f"--out={index}"]) == 2
    assert "holds an index of other inputs" in capsys.readouterr().err
    assert build_index([str(root / "more.jsonl")], root / "other")["status"] == "built"
    with pytest.raises(ValueError, match="'id' 'x' appears twice|id 'x' appears twice"):
        build_index([str(root / "more.jsonl")] * 2, root / "twice")
    assert RetrievalIndex.load(index) is RetrievalIndex.load(index)  # read once per process


def test_search_finds_the_evidence_and_open_reads_it(corpus):
    index = RetrievalIndex.load(corpus["index"])
    questions = corpus["questions"]
    hits = [any(q["evidence"] in p["text"] for p in index.search(q["question"], 3))
            for q in questions]  # fmt: skip
    assert np.mean(hits) >= 0.95, np.mean(hits)
    record = retrieval_records(questions[:1], corpus["documents"], corpus["index"])[0]
    env = make_env("retrieval", record)
    assert env.reset()[0]["content"] == RETRIEVAL_SYSTEM
    search = {"name": "search", "arguments": {"query": questions[0]["question"]}}
    missing = {"name": "open", "arguments": {"doc_id": "nope", "span": 3}}
    calls = [{"function": search}, {"function": missing}]
    step = env.step({"role": "assistant", "content": "", "tool_calls": calls})
    found, missing = (m["content"] for m in step.observations)
    assert found.startswith("[registry-0-0#") and questions[0]["evidence"] in found
    assert missing.startswith("Error: ValueError: there is no passage nope#3; search first")
    assert step.info["tool_calls"] == 2 and step.info["tool_errors"] == 1
    # The answer turn: scored by the record's domain (grounded_qa) against its document.
    answer = cited_answer(questions[0], found)
    assert env.step({"role": "assistant", "content": answer}).done
    assert default_registry().score(record, answer)[0] == 1.0
    with pytest.raises(ValueError, match="a retrieval record needs 'index'"):
        make_env("retrieval", {"prompt": "Which river?"})


def test_retrieval_and_fitting_answer_where_truncation_cannot(corpus):
    """A reader that answers from what it was given: the first WINDOW tokens of the document,
    the document fitted to WINDOW by relevance, or the top passage `search` returns."""
    tokenizer, registry = corpus["tokenizer"], default_registry()
    questions, documents = corpus["questions"], corpus["documents"]
    scores = {"truncated": [], "fitted": [], "retrieval": []}
    index = RetrievalIndex.load(corpus["index"])
    for q, record in zip(questions, context_records(questions, documents), strict=True):
        head = tokenizer.decode(tokenizer.encode(record["document"])[: WINDOW - 24])
        fitted = fit_prompt(record, tokenizer, WINDOW)
        assert len(encode_prompt(fitted, tokenizer)) <= WINDOW
        top = index.search(q["question"], 1)[0]["text"]
        for name, text in (("truncated", head), ("fitted", fitted["prompt"]),
                           ("retrieval", top)):  # fmt: skip
            scores[name].append(registry.score(record, cited_answer(q, text))[0])
    means = {k: float(np.mean(v)) for k, v in scores.items()}
    assert means["truncated"] < 0.3 and means["fitted"] >= 0.85 and means["retrieval"] >= 0.9
    assert means["retrieval"] > means["truncated"] + 0.5, means


def test_rl_prompts_fit_their_documents_per_domain(corpus):
    records = context_records(corpus["questions"][:16], corpus["documents"])
    path = corpus["root"] / "context.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = build(DataConfig, {"sources": [{"path": str(path), "domain": "grounded_qa"}],
                                "batch_size": 4, "max_len": 512, "packing": False})  # fmt: skip
    kwargs = dict(max_prompt_len=WINDOW, process_index=0, process_count=1)
    prompts = PromptData(config, corpus["tokenizer"], fit_documents={"grounded_qa": 256}, **kwargs)
    assert prompts.stats["fitted"] == 16 and prompts.stats["overlong"] == 0
    assert all(len(p["prompt_ids"]) <= 256 for p in prompts.prompts)
    # The question is kept whole, and the record's document (for the reward) too.
    for p, r in zip(prompts.prompts, records, strict=True):
        assert p["record"]["prompt"].endswith(r["prompt"].split("\n\n")[-1])
        assert p["record"]["document"] == r["document"]
    with pytest.raises(ValueError, match="no usable prompt"):  # without it: all too long
        PromptData(config, corpus["tokenizer"], **kwargs)


def test_the_demo_assets_fit_the_window_and_hold_out_their_registries(tmp_path):
    """`posttrain demo --task=retrieval`'s assets: every SFT episode (a search and its cited
    answer) and every truncated prompt with room for its answer fits the tiny model's window,
    the documents do not, truncation keeps a prefix of the document, and the held-out questions
    are about registries that no SFT or GRPO record is about; the index is built once."""
    from posttrain.demo import build_retrieval_assets
    from posttrain.demo._retrieval import ANSWER_TOKENS, WINDOW

    assets = build_retrieval_assets(tmp_path, sft_docs=3, rl_docs=1, eval_docs=1)
    assert assets["index_status"] == "built"
    tokenizer = load_tokenizer(assets["tokenizer"])
    read = {name: [json.loads(line) for line in open(assets[name])] for name in assets
            if name.endswith(("sft", "train", "eval"))}  # fmt: skip
    documents = {r["document"] for r in read["eval"]}
    assert len(documents) == 1 and len(read["eval"]) == 96  # (24 towns x 4 facts)
    assert min(len(tokenizer.encode(d)) for d in documents) > 2 * WINDOW
    assert not documents & {r["document"] for r in read["train"] + read["truncated_train"]}
    for episode in read["sft"]:
        ids, _ = tokenizer.encode_chat(episode["messages"], tools=episode["tools"])
        assert len(ids) <= WINDOW
        found, answer = episode["messages"][-2]["content"], episode["messages"][-1]["content"]
        cited = answer.startswith("<cite>")
        assert not cited or answer[6 : answer.index("</cite>")] in found
    assert np.mean([e["messages"][-1]["content"].startswith("<cite>") for e in read["sft"]]) > 0.8
    for record in read["truncated_eval"] + read["truncated_train"]:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": record["prompt"]}],
                                               add_generation_prompt=True)  # fmt: skip
        assert len(prompt) + ANSWER_TOKENS <= WINDOW
        assert record["document"].startswith(record["kept"])
    kept = [r["evidence_kept"] for r in read["truncated_eval"]]
    assert 0 < np.mean(kept) < 0.5  # some evidence survives truncation, most does not
    assert (
        build_retrieval_assets(tmp_path, sft_docs=3, rl_docs=1, eval_docs=1)["index_status"]
        == "reused"
    )


@pytest.mark.slow  # ~29 minutes: `posttrain demo --task=retrieval`
def test_a_tiny_model_that_searches_answers_what_one_reading_truncated_documents_cannot(
    tmp_path, devices
):
    """`posttrain demo --task=retrieval`: the tiny model trained with the same recipe twice (SFT
    from scratch, then GRPO), with the `retrieval` environment and on documents truncated to
    its window. On held-out registries the searching model searches every time and answers
    more questions exactly than any reader of the truncated documents could (those whose
    evidence survives truncation), and than the model trained on them (measured 2026-12-06,
    one process: 35.4% exact against 0.0%, a ceiling of 23.4%; docs/agents.md)."""
    from posttrain.demo import run_retrieval_demo

    quiet = {"train.progress": False}
    result = run_retrieval_demo(str(tmp_path), sft_overrides=quiet, rl_overrides=quiet)
    ceiling, search, truncated = result["truncated_ceiling"], result["search"], result["truncated"]
    assert 0.15 < ceiling < 0.4, ceiling
    assert search["rl"]["searches"] >= 0.95, search
    assert search["rl"]["exact"] > ceiling + 0.03, (search, ceiling)
    assert search["rl"]["reward"] > truncated["rl"]["reward"] + 0.1, (search, truncated)
    assert truncated["rl"]["searches"] == 0 and truncated["rl"]["exact"] <= ceiling, truncated
