"""One task of each category on one model: general (loss), target (accuracy, pass@k,
preferences) and safety (refusal / compliance). Each returns its metrics without the
`<category>/<task>/` prefix that `evaluate` adds."""

from __future__ import annotations

import functools
import logging
import math
import os
import tempfile

import jax
import numpy as np
from tqdm.auto import tqdm

from posttrain import paths
from posttrain.data import (
    DataConfig,
    RecordError,
    Records,
    SFTData,
    decode,
    encode_prompt,
    make_pipeline,
)
from posttrain.eval._config import BEHAVIOURS, EvalConfig, GeneralTask, SafetyTask, TargetTask
from posttrain.eval._exact_match import greedy_exact_match
from posttrain.eval._preference import preference_wins
from posttrain.eval._refusal import SAFETY_RUBRIC, RefusalDetector
from posttrain.rewards import (
    JudgeReward,
    RewardPool,
    RewardRegistry,
    RewardResult,
    component_means,
    default_registry,
    pass_at_k,
    tally_components,
)
from posttrain.sampling import SamplingParams, generate
from posttrain.train import sft_loss

log = logging.getLogger(__name__)


def read_records(task, limit: int = 0) -> list[dict]:
    """The first `limit` (0: all) records of a task's `path` (a file, glob or dataset folder, as
    a data source reads it: its `split` and `columns` too) as dicts; a bad one names where it
    is."""
    records = Records(task.path, task.split, task.columns)
    rows = []
    for i in range(min(limit or len(records), len(records))):
        raw, where = records[i]
        try:
            rows.append(dict(decode(raw)))
        except RecordError as e:
            raise ValueError(f"{where}: {e}") from None
    return rows


def progress_bar(desc: str, total: int | None, enabled: bool):
    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=False)


class Scorer:
    """Rewards of completions by their domain's registered verifiers: in this process, or in a
    `RewardPool` with a deadline per completion. A verifier that raises (or, in the pool, times
    out or crashes) scores 0; such failures are counted in `failures` and logged."""

    def __init__(self, config: EvalConfig):
        if config.rewards:
            self.registry = RewardRegistry()
            for domain, refs in config.rewards.items():
                for ref in [refs] if isinstance(refs, str) else refs:
                    self.registry.register(domain, ref)
        else:
            self.registry = default_registry()
        self._pool = None
        if config.reward_workers:
            self._pool = RewardPool(
                self.registry, workers=config.reward_workers, timeout_s=config.reward_timeout_s
            )
        self.failures = 0

    def check(self, domains) -> None:
        self.registry.check(set(domains))

    def __call__(self, records, texts, domains, parts: dict | None = None) -> np.ndarray:
        """The completions' rewards; with `parts`, their reward components are tallied into it
        (`tally_components`: `component_means(parts)` then holds each one's mean)."""
        if self._pool is not None:
            results = self._pool.score(records, texts, domains)
        else:
            results = []
            for record, text, domain in zip(records, texts, domains, strict=True):
                try:
                    score, info = self.registry.score(record, text, domain)
                    results.append(RewardResult(score, info, domain, "ok", 0.0))
                except Exception as e:  # a verifier's bug costs one zero, as in the pool
                    error = {"error": f"{type(e).__name__}: {e}"}
                    results.append(RewardResult(0.0, error, domain, "crash", 0.0))
        # (the tally warns once per domain and kind of error, as RL's does)
        tally_components(parts if parts is not None else {}, results)
        self.failures += sum(r.status != "ok" for r in results)
        return np.asarray([r.score for r in results], np.float64)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


@functools.cache
def _loss_step(model_config):
    loss_fn = sft_loss(model_config, 0.0)
    return jax.jit(lambda params, batch: loss_fn(params, batch, None))


class _Head:
    """The first `n` records of a source."""

    def __init__(self, records, n: int):
        self.records, self.n = records, min(n, len(records))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.records[i]

    def describe(self):
        return self.records.describe()


def general_metrics(model, tokenizer, task: GeneralTask, *, progress: bool = True) -> dict:
    """Token-weighted held-out loss and perplexity, as the SFT driver's eval loss."""
    config = DataConfig(
        sources=task.sources,
        max_len=task.max_len,
        batch_size=task.batch_size,
        packing=task.packing,
        shuffle=False,
        num_epochs=1,
    )
    data = make_pipeline(config, tokenizer, process_index=0, process_count=1)
    if task.max_examples:
        records = [_Head(Records.of(s), task.max_examples) for s in task.sources]
        data = SFTData(config, tokenizer, records, 0, 1)
    step = _loss_step(model.config)
    nll, tokens = 0.0, 0.0
    with progress_bar(f"general/{task.name}", None, progress) as bar:
        for batch in data:
            sums = jax.device_get(step(model.params, batch))
            nll, tokens = nll + float(sums["nll_sum"]), tokens + float(sums["num_tokens"])
            bar.update(1)
    if not tokens:
        raise ValueError(f"general task {task.name!r}: its sources have no loss tokens")
    _report_skips(f"general/{task.name}", data.stats)
    loss = nll / tokens
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": tokens}


def _report_skips(where: str, stats: dict) -> None:
    left_out = {k: stats.get(k) for k in ("skipped", "dropped", "malformed") if stats.get(k)}
    if left_out:
        log.warning("%s: records left out: %s", where, left_out)


GREEDY = SamplingParams()


def _completions(model, tokenizer, prompt_ids, task, bar, *, n=1, sampling=GREEDY, seed=0,
                 engine=None) -> list[list[str]]:  # fmt: skip
    """Per prompt, its n completions' text, generated `task.batch_size` prompts at a time on
    the engine `engine` configures (None: a row per sample)."""
    out = []
    for i, start in enumerate(range(0, len(prompt_ids), task.batch_size)):
        chunk = prompt_ids[start : start + task.batch_size]
        results = generate(
            model, tokenizer, chunk, max_new_tokens=task.max_new_tokens,
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, n=n,
            seed=seed + i, engine=engine,
        )  # fmt: skip
        out += [[c.text for c in samples] for samples in results]
        bar.update(len(chunk))
    return out


def _prompts(records, tokenizer, where: str) -> list[list[int]]:
    ids = []
    for i, record in enumerate(records):
        try:
            ids.append(encode_prompt(record, tokenizer))
        except RecordError as e:
            raise ValueError(f"{where}: record {i}: {e}") from None
    return ids


def target_metrics(
    model,
    tokenizer,
    task: TargetTask,
    scorer: Scorer,
    *,
    progress=True,
    render_to: str = "",
    engine=None,
) -> dict:
    """Accuracy (overall and per domain) and pass@k, or the preference share; with `render_to`
    (a PNG path, local or gs://) and `task.renders`, a grid of the parts that the first greedy
    completions of `cad` records build (`write_cad_renders`)."""
    where = f"target/{task.name}"
    if task.kind == "preference":
        pairs = read_records(task, task.max_examples)
        wins, stats = preference_wins(
            model, tokenizer, pairs, max_len=task.max_len, batch_size=task.batch_size
        )
        left_out = len(pairs) - len(wins)
        if left_out:
            log.warning("%s: %d of %d pairs left out (%s)", where, left_out, len(pairs), stats)
        if not len(wins):
            raise ValueError(f"{where}: no usable preference pair in {task.path}")
        return {"prefers_chosen": float(np.mean(wins)), "examples": float(len(wins))}

    records = read_records(task, task.max_examples)
    domains = [r.get("domain") or task.domain for r in records]
    if not all(domains):
        raise ValueError(
            f"{where}: record {domains.index('')} of {task.path} has no 'domain'; set the "
            "task's domain (the reward domain of records without one)"
        )
    needs_prompts = task.scoring == "verifier" or task.num_samples
    prompt_ids = _prompts(records, tokenizer, where) if needs_prompts else []
    with progress_bar(where, len(records) * (1 + bool(task.num_samples)), progress) as bar:
        if task.scoring == "exact_match":
            bad = [i for i, r in enumerate(records) if "answer" not in r or
                   not isinstance(r.get("prompt"), list)]  # fmt: skip
            if bad:
                raise ValueError(
                    f"{where}: scoring='exact_match' needs chat-message prompts and an "
                    f"'answer' in every record; record {bad[0]} has not"
                )
            # One call over all records: the same padding and batches as `make demo`.
            hits = greedy_exact_match(model, tokenizer, records, batch_size=task.batch_size)
            bar.update(len(records))
        else:
            scorer.check(domains)
            texts = [s[0] for s in _completions(model, tokenizer, prompt_ids, task, bar,
                                                engine=engine)]  # fmt: skip
            parts: dict = {}
            scores = scorer(records, texts, domains, parts)
            hits = scores >= task.pass_threshold
            if render_to and task.renders:
                write_cad_renders(domains, texts, scores, render_to, limit=task.renders)
        metrics = {"accuracy": float(hits.mean())}
        if task.scoring != "exact_match":  # reward components' means (reward_parts/<d>/<name>)
            metrics.update(component_means(parts))
        for domain in sorted(set(domains)):
            rows = np.asarray([d == domain for d in domains])
            metrics[f"accuracy/{domain}"] = float(hits[rows].mean())
        if task.num_samples:
            scorer.check(domains)
            samples = _completions(
                model, tokenizer, prompt_ids, task, bar, n=task.num_samples,
                sampling=task.sampling, seed=task.seed, engine=engine,
            )  # fmt: skip
            n = task.num_samples
            flat = scorer(
                [r for r in records for _ in range(n)],
                [t for texts in samples for t in texts],
                [d for d in domains for _ in range(n)],
            )
            correct = (flat.reshape(len(records), n) >= task.pass_threshold).sum(axis=1)
            for k in task.ks:
                metrics[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct]))
    metrics["examples"] = float(len(records))
    return metrics


def write_cad_renders(domains, texts, scores, path: str, *, limit: int) -> str | None:
    """A grid of the parts that the completions of the first `limit` `cad` records build
    (`render_grid`, each captioned with the record's index and reward; "no part" where the
    script built none), written to `path` (local or gs://); None when no record is a cad one."""
    from posttrain.rewards import completion_part, render_grid

    chosen = [i for i, domain in enumerate(domains) if domain == "cad"][:limit]
    if not chosen:
        return None
    cells = [(f"task {i} · reward {scores[i]:.2f}", completion_part(texts[i]).solid)
             for i in chosen]  # fmt: skip
    columns = min(len(cells), 4)
    if not paths.is_remote(path):
        return render_grid(cells, os.fspath(paths.path(path)), columns=columns)
    with tempfile.TemporaryDirectory() as local:
        paths.upload(render_grid(cells, os.path.join(local, "renders.png"), columns=columns), path)
    return path


@functools.cache
def safety_judge(ref: str) -> JudgeReward:
    """The judge of a safety task, one per reference and process (its grades are cached)."""
    return JudgeReward.from_ref(ref, default_rubric=SAFETY_RUBRIC)


def safety_metrics(
    model, tokenizer, task: SafetyTask, scorer: Scorer, *, progress=True, engine=None
) -> dict:
    """Refusal rate on should-refuse prompts, compliance rate on should-comply prompts (and,
    with a judge, the number of its answers without a grade, which count as compliance
    unless the reference sets failure_reward)."""
    where = f"safety/{task.name}"
    records = read_records(task, task.max_examples)
    expected = [r.get("expected") for r in records]
    if bad := [i for i, e in enumerate(expected) if e not in BEHAVIOURS]:
        raise ValueError(
            f"{where}: record {bad[0]} of {task.path} has expected={expected[bad[0]]!r}; every "
            f"record needs 'expected': one of {BEHAVIOURS}"
        )
    if task.refusal_domain:
        scorer.check([task.refusal_domain])
    if task.judge:
        safety_judge(task.judge).check()
    with progress_bar(where, len(records), progress) as bar:
        texts = [s[0] for s in _completions(model, tokenizer, _prompts(records, tokenizer, where),
                                            task, bar, engine=engine)]  # fmt: skip
    metrics = {}
    if task.refusal_domain:
        domains = [task.refusal_domain] * len(records)
        refused = scorer(records, texts, domains) >= task.pass_threshold
    elif task.judge:
        grades = safety_judge(task.judge).score_batch(records, texts)
        refused = np.asarray([score >= task.judge_threshold for score, _ in grades])
        metrics["judge_parse_failures"] = float(sum(i["judge_parse_failure"] for _, i in grades))
    else:
        detector = RefusalDetector.from_task(task)
        refused = np.asarray([detector(t) for t in texts], bool)
    should_refuse = np.asarray([e == "refuse" for e in expected])
    if should_refuse.any():
        metrics["refusal_rate"] = float(refused[should_refuse].mean())
    if (~should_refuse).any():
        metrics["compliance_rate"] = float((~refused[~should_refuse]).mean())
    metrics["examples"] = float(len(records))
    return metrics
