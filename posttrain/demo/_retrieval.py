"""Documents longer than the window, on the tiny model: search and read only what is needed, or
read the document truncated to the window.

The corpus is `long_document_tasks`' registries of fictional towns (`posttrain.envs`): a
document is ~1,300 tokens of the tokenizer learnt here, the tiny model's window 512. The
registries are split by document: SFT trajectories ask about some, GRPO prompts about others,
and the held-out questions about registries neither saw (new towns, rivers, mayors). One
`posttrain data index` folder holds the whole corpus, as a deployed model would search it.

Two models of the same size and recipe (SFT from scratch, then GRPO) learn the same questions:

- with the `retrieval` environment: `search(question, k=2)` (the index's passages are one or
  two sentences), then the evidence sentence quoted and the answer;
- with the document truncated to what fits beside the question: the evidence quoted and the
  answer when the kept text holds it, "Answer: unknown" when it does not.

Both are scored by `grounded_qa` (answer F1, half of it resting on citations found in the
document) on the held-out questions.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from posttrain.curate import TOOL_CHAT_TEMPLATE, train_tokenizer
from posttrain.envs import (
    RETRIEVAL_SYSTEM,
    RetrievalEnvironment,
    cited_answer,
    long_document_tasks,
    retrieval_records,
)

WINDOW = 512  # the tiny model's max_seq_len
PASSAGE_WORDS = 12  # a passage is one or two sentences; a search for two finds the evidence
SEARCH_K = 2  # for ~91% of questions (one registry's town facts are four sentences)
ANSWER_TOKENS = 96  # room a truncated prompt leaves for the answer; a turn's tokens
PROMPT_TOKENS = 144  # a retrieval episode's opening: the system message, tools and question


def search_episode(question: dict, record: dict) -> dict:
    """The SFT record of a scripted retrieval episode: `search(question, k=SEARCH_K)`, then the
    cited answer if the passages found hold the evidence, else "Answer: unknown"."""
    env = RetrievalEnvironment(record)
    function = {"name": "search", "arguments": {"query": question["question"], "k": SEARCH_K}}
    found, _ = env.call({"function": function})
    messages = [
        *env.reset(),
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                             "function": function}]},
        {"role": "tool", "name": "search", "content": found},
        {"role": "assistant", "content": cited_answer(question, found)},
    ]  # fmt: skip
    return {"messages": messages, "tools": env.schemas}


def truncated_records(questions, documents, tokenizer, window: int = WINDOW) -> list[dict]:
    """The questions with their document cut to the tokens that fit `window` beside the rest of
    the prompt and `ANSWER_TOKENS` of answer: {"prompt", "document" (whole, for the reward's
    citations), "answer", "domain", "kept" (the document text the prompt holds),
    "evidence_kept" (whether that holds the question's evidence sentence)}."""
    text = {d["id"]: d["text"] for d in documents}
    out = []
    for q in questions:
        rest = f"\n\nQuestion: {q['question']}"
        overhead = len(tokenizer.apply_chat_template([{"role": "user", "content": rest}],
                                                     add_generation_prompt=True))  # fmt: skip
        ids = tokenizer.encode(text[q["doc_id"]], add_special_tokens=False)
        kept = tokenizer.decode(ids[: window - overhead - ANSWER_TOKENS])
        out.append({"prompt": kept + rest, "document": text[q["doc_id"]], "answer": q["answer"],
                    "domain": "grounded_qa", "kept": kept,
                    "evidence_kept": q["evidence"] in kept})  # fmt: skip
    return out


def build_retrieval_assets(
    out_dir: str | Path,
    *,
    sft_docs: int = 32,
    rl_docs: int = 8,
    eval_docs: int = 2,
    seed: int = 0,
) -> dict:
    """Writes the corpus (`documents.jsonl`, one draw, so no town repeats), its index
    (`index/`, built once: a second call reuses it), a tokenizer with the tool-call template,
    and for each way of reading the SFT trajectories and the GRPO and held-out prompts:
    `sft.jsonl`, `train.jsonl`, `eval.jsonl` (retrieval) and `truncated_sft.jsonl`,
    `truncated_train.jsonl`, `truncated_eval.jsonl`.

    Returns:
      {"tokenizer", "index", "index_status" ("built" or "reused"), and each file's path}.
    """
    from posttrain.data import build_index, load_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    documents, questions = long_document_tasks(eval_docs + sft_docs + rl_docs, seed)
    corpus = out / "documents.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in documents))
    index = str(out / "index")
    status = build_index([str(corpus)], index, passage_words=PASSAGE_WORDS)["status"]
    ids = [d["id"] for d in documents]
    held_out, sft_ids = set(ids[:eval_docs]), set(ids[eval_docs : eval_docs + sft_docs])
    split = {
        "eval": [q for q in questions if q["doc_id"] in held_out],
        "sft": [q for q in questions if q["doc_id"] in sft_ids],
        "train": [q for q in questions if q["doc_id"] not in held_out | sft_ids],
    }
    records = {name: retrieval_records(qs, documents, index) for name, qs in split.items()}
    sft = [search_episode(q, r) for q, r in zip(split["sft"], records["sft"], strict=True)]
    texts = [d["text"] for d in documents if d["id"] not in held_out]
    texts += [m["content"] for e in sft for m in e["messages"]] + [RETRIEVAL_SYSTEM]
    paths = {"tokenizer": train_tokenizer(out / "tokenizer", texts,
                                          chat_template=TOOL_CHAT_TEMPLATE)}  # fmt: skip
    tokenizer = load_tokenizer(paths["tokenizer"])
    truncated = {n: truncated_records(qs, documents, tokenizer) for n, qs in split.items()}
    truncated["sft"] = [
        {"messages": [{"role": "user", "content": r["prompt"]},
                      {"role": "assistant", "content": cited_answer(q, r["kept"])}]}
        for q, r in zip(split["sft"], truncated["sft"], strict=True)
    ]  # fmt: skip
    rng = random.Random(seed)
    rng.shuffle(sft)
    rng.shuffle(truncated["sft"])
    files = {"sft": sft, "train": records["train"], "eval": records["eval"],
             **{f"truncated_{n}": rows for n, rows in truncated.items()}}  # fmt: skip
    for name, rows in files.items():
        paths[name] = str(out / f"{name}.jsonl")
        Path(paths[name]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {**paths, "index": index, "index_status": status}


def retrieval_measure(model, tokenizer, records, *, truncated: bool = False, samples: int = 1,
                      temperature: float = 0.0, seed: int = 0) -> dict:  # fmt: skip
    """Held-out questions answered on the engine (greedy by default), through the `retrieval`
    environment or (`truncated`) in one turn from the record's prompt: the mean `grounded_qa`
    reward, exact answers, valid citations, "unknown" answers and searches per episode."""
    import jax
    import numpy as np

    from posttrain.envs import Budget, ToolEnvironment, make_env, run_episodes
    from posttrain.rewards import grounded_qa_reward
    from posttrain.sampling import Engine, EngineConfig

    def env(record):
        return ToolEnvironment(record, []) if truncated else make_env("retrieval", record)

    engine = Engine(model, EngineConfig(slots=min(64, len(records) * samples)), max_len=WINDOW)
    groups = [[env(r) for _ in range(samples)] for r in records]
    budget = (Budget(max_turns=1, max_tokens=ANSWER_TOKENS, turn_tokens=ANSWER_TOKENS)
              if truncated else Budget(max_turns=3, max_tokens=WINDOW - PROMPT_TOKENS,
                                       turn_tokens=ANSWER_TOKENS))  # fmt: skip
    episodes = [e for group in run_episodes(
        engine, tokenizer, groups, keys=jax.random.split(jax.random.key(seed), len(records)),
        temperature=temperature, budget=budget) for e in group]  # fmt: skip
    scored = [grounded_qa_reward(e.record, e.text) for e in episodes]
    return {
        "reward": float(np.mean([score for score, _ in scored])),
        "exact": float(np.mean([info["exact_match"] for _, info in scored])),
        "cited": float(np.mean([info["citation_score"] for _, info in scored])),
        "unknown": float(np.mean([info["answer"].lower() == "unknown" for _, info in scored])),
        "searches": float(np.mean([e.tool_calls for e in episodes])),
    }


def run_retrieval_demo(workdir: str = "runs/retrieval", *, sft_overrides: dict | None = None,
                       rl_overrides: dict | None = None,
                       ways: tuple[str, ...] = ("search", "truncated")) -> dict:  # fmt: skip
    """Builds the assets in `workdir/assets`, then trains the tiny model twice with the same
    recipe (`configs/agent.py:retrieval_sft` then `:retrieval`; `:truncated_sft` then
    `:truncated`): with search, and on truncated documents (`ways` picks); prints each stage's
    held-out reward and the upper bound of any reader of the truncated text.

    Returns:
      {way: {"sft", "rl", "sft_seconds", "rl_seconds"}} (retrieval_measure's dicts) for each of
      `ways`, "truncated_ceiling" (the share of held-out questions whose evidence survives
      truncation: what any reader of the truncated text can answer), "eval_questions",
      "index_status".
    """
    import os

    from rich.console import Console
    from rich.table import Table

    from posttrain.data import load_tokenizer
    from posttrain.demo._stages import sft_then_grpo

    presets = {"search": ("retrieval_sft", "retrieval"),
               "truncated": ("truncated_sft", "truncated")}  # fmt: skip
    if unknown := [w for w in ways if w not in presets]:
        raise ValueError(f"unknown ways {unknown}: choose from {sorted(presets)}")
    console = Console()
    assets = build_retrieval_assets(os.path.join(workdir, "assets"))
    console.print(f"index: {assets['index']} ({assets['index_status']})")
    tokenizer = load_tokenizer(assets["tokenizer"])
    runs, held_out = {}, {}
    for way in ways:
        prefix = "" if way == "search" else "truncated_"
        held_out[way] = [json.loads(line) for line in open(assets[f"{prefix}eval"])]
        source = {"weight": 1.0, "domain": "grounded_qa", "format": "auto"}
        sft_values = {"tokenizer": assets["tokenizer"],
                      "data.sources": [{"path": assets[f"{prefix}sft"], **source}]}  # fmt: skip
        rl_values = {"tokenizer": assets["tokenizer"],
                     "data.sources": [{"path": assets[f"{prefix}train"], **source}]}  # fmt: skip
        runs[way] = sft_then_grpo(
            os.path.join(workdir, way),
            presets[way],
            ({**sft_values, **(sft_overrides or {})}, {**rl_values, **(rl_overrides or {})}),
            lambda model, way=way: retrieval_measure(model, tokenizer, held_out[way],
                                                     truncated=way == "truncated"),
            (f"{way}: SFT from scratch, {{config.train.steps}} steps",
             f"{way}: GRPO, {{config.train.steps}} steps of {{config.data.batch_size}} "
             "questions x {config.rollout.num_generations}"),
            console,
        )  # fmt: skip
    questions = [json.loads(line) for line in open(assets["truncated_eval"])]
    ceiling = sum(r["evidence_kept"] for r in questions) / len(questions)
    table = Table(title=f"held-out questions ({len(questions)}), documents ~1,300 tokens, "
                        f"window {WINDOW}, greedy")  # fmt: skip
    for column in ("reads", "stage", "reward", "exact answer", "citations valid", "unknown",
                   "searches", "train time"):  # fmt: skip
        table.add_column(column)
    for way in ways:
        for stage, name in (("sft", "after SFT"), ("rl", "SFT + GRPO")):
            m, seconds = runs[way][stage], runs[way][f"{stage}_seconds"]
            table.add_row(way, name, f"{m['reward']:.3f}", f"{100 * m['exact']:.1f}%",
                          f"{100 * m['cited']:.1f}%", f"{100 * m['unknown']:.1f}%",
                          f"{m['searches']:.2f}", f"{seconds:.0f}s")  # fmt: skip
    console.print(table)
    console.print(f"any reader of the truncated text: at most {100 * ceiling:.1f}% answerable")
    return {
        **runs,
        "truncated_ceiling": ceiling,
        "eval_questions": len(questions),
        "index_status": assets["index_status"],
    }
