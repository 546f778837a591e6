"""On-policy data from a checkpoint: preference pairs (`posttrain data pairs`) and
rejection-sampled SFT data (`posttrain data synth`).

Both stream prompt records (JSONL, Parquet or ArrayRecord, local or gs://) in chunks through
RL's single-turn rollout (`posttrain.rl.sample_groups` on the paged engine, `samples`
completions per prompt, and `score_groups`: every completion scored with its prompt's reward
domain, a verifier, a reward model "rm:<path>" or a judge, in the reward pool),
and write what they keep as they go: nothing holds the whole prompt set in memory. Each
prompt's samples are drawn from its own seed (`seed` and its position in the stream), so the
output does not depend on the chunk size, and the same inputs give the same file.

    model, tokenizer = load_model_and_tokenizer("runs/demo/sft")
    stats = make_pairs(model, tokenizer, [("problems.jsonl", "arithmetic")], "pairs.jsonl",
                       SampleConfig(samples=4, max_new_tokens=8))
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from posttrain.config import ConfigError
from posttrain.data import RecordError, Records, RecordWriter, encode_prompt, read_records
from posttrain.rewards import RewardPool
from posttrain.rl import RewardsConfig, gather_groups, prompt_share, sample_groups, score_groups
from posttrain.sampling import (
    Completion,
    Engine,
    EngineConfig,
    SamplingParams,
)

# Fields a written record sets itself (an input record's own are replaced).
_OUTPUT_FIELDS = ("chosen", "rejected", "completion", "messages")


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    """How `make_pairs` and `synthesize` sample and score.

    Attributes:
      samples: completions per prompt.
      max_new_tokens, sampling: the completion budget and how each token is drawn.
      max_prompt_len: longer prompts are left out (counted as overlong); at most the model's
        max_seq_len - max_new_tokens.
      seed: prompt i's samples draw from seed `seed * 1_000_003 + i` (i counts usable
        prompts from the start of the stream, `offset` included).
      offset, limit: skip the first `offset` usable prompts, then use at most `limit` (0: all);
        iterative rounds take fresh prompts this way.
      chunk: prompts sampled together (the engine decodes `chunk x samples` rows at once).
      rewards: the reward functions by domain (empty: the built-in registry), the verifier
        workers and their per-completion timeout.
    """

    samples: int = 4
    max_new_tokens: int = 128
    max_prompt_len: int = 512
    sampling: SamplingParams = SamplingParams(temperature=1.0)
    seed: int = 0
    offset: int = 0
    limit: int = 0
    chunk: int = 64
    rewards: RewardsConfig = RewardsConfig()

    def __post_init__(self):
        if self.samples < 1 or self.max_new_tokens < 1 or self.max_prompt_len < 1:
            raise ConfigError("samples, max_new_tokens and max_prompt_len must be >= 1")
        if self.chunk < 1 or self.offset < 0 or self.limit < 0:
            raise ConfigError("chunk must be >= 1, offset and limit >= 0")


def _prompts(sources, tokenizer, c: SampleConfig, counts: dict, registry) -> Iterator[dict]:
    """The usable prompts of `sources` [(Records, domain of records without one)], counted."""
    index, checked = 0, set()
    for records, default_domain in sources:
        for record, where in read_records(records):
            counts["read"] += 1
            domain = record.get("domain") or default_domain
            try:
                if not isinstance(domain, str) or not domain:
                    raise RecordError(
                        "no 'domain' field to pick its reward; add one or pass --domain"
                    )
                ids = encode_prompt(record, tokenizer)
                if not ids:
                    raise RecordError("the prompt encodes to no token")
            except RecordError as e:
                counts["malformed"] += 1
                if len(counts["errors"]) < 5:
                    counts["errors"].append(f"{where}: {e}")
                continue
            if len(ids) > c.max_prompt_len:
                counts["overlong"] += 1
                continue
            if domain not in checked:  # an unknown domain fails here, not in the pool
                registry.check([domain])
                checked.add(domain)
            index += 1
            if index <= c.offset:
                continue
            position = counts["read"] - 1  # (in the records of all sources, malformed too)
            yield {"record": record, "prompt_ids": ids, "domain": domain, "index": index - 1,
                   "position": position}  # fmt: skip
            if c.limit and index - c.offset >= c.limit:
                return


def scored_groups(
    model, tokenizer, sources: Sequence[tuple[str, str]], c: SampleConfig, counts: dict, *,
    progress: bool = True, desc: str = "sampling",
) -> Iterator[tuple[dict, list[Completion], np.ndarray]]:  # fmt: skip
    """(prompt, its `c.samples` completions, their rewards) for every usable prompt of
    `sources`, in order; `counts` gets read / malformed / overlong / prompts and the first
    errors."""
    tallies = ("read", "malformed", "overlong", "prompts", "samples", "passed", "reward_sum")
    counts.update({k: counts.get(k, 0) for k in tallies})
    counts.setdefault("errors", [])
    registry = c.rewards.registry()
    sources = [(Records(path), domain) for path, domain in sources]  # (indexed once)
    total = sum(len(records) for records, _ in sources)
    total = max(0, total - c.offset) if not c.limit else min(c.limit, max(0, total - c.offset))
    longest = min(c.max_prompt_len, model.config.max_seq_len - c.max_new_tokens)
    if longest < 1:
        raise ConfigError(
            f"max_new_tokens={c.max_new_tokens} leaves no room for a prompt in the model's "
            f"max_seq_len={model.config.max_seq_len}; lower it"
        )
    c = dataclasses.replace(c, max_prompt_len=longest)  # (longer prompts: counted as overlong)
    engine = Engine(
        model,
        EngineConfig(slots=min(c.chunk * c.samples, 256), prefill_bucket=16),
        max_len=c.max_prompt_len + c.max_new_tokens,
        eos_ids=tokenizer.eos_ids,
    )
    first = jax.process_index() == 0
    bar = tqdm(total=total, desc=desc, disable=not (progress and first), unit="prompt")
    with RewardPool(registry, workers=c.rewards.workers, timeout_s=c.rewards.timeout_s) as pool:
        batch: list[dict] = []
        stream = _prompts(sources, tokenizer, c, counts, registry)
        for prompt in _with_end(stream):  # (None: the end, to sample the last chunk)
            if prompt is not None:
                batch.append(prompt)
            if batch and (prompt is None or len(batch) == c.chunk):
                completions, rewards = _sampled_and_scored(engine, model, tokenizer, pool, batch, c)
                counts["samples"] += rewards.size
                counts["passed"] += int((rewards >= c.rewards.pass_threshold).sum())
                counts["reward_sum"] += float(rewards.sum())
                yield from zip(batch, completions, rewards, strict=True)
                counts["prompts"] += len(batch)
                bar.update(len(batch))
                batch = []
    bar.close()


def _sampled_and_scored(engine, model, tokenizer, pool, batch: list[dict], c: SampleConfig):
    """(completions, rewards `[prompts, samples]`) of a chunk of prompts. On several processes
    each samples and scores its share of the chunk (`prompt_share`) and every process gets all
    of them back (`gather_groups`); prompt i's samples are keyed by its index, so they are the
    ones one process draws."""
    several = jax.process_count() > 1
    share = prompt_share(len(batch)) if several else slice(0, len(batch))
    mine, completions, rewards = batch[share], [], np.zeros((0, c.samples), np.float32)
    if mine:
        completions = sample_groups(
            engine, model, tokenizer, mine, sampling=c.sampling, n=c.samples,
            max_new_tokens=c.max_new_tokens,
            seeds=[(c.seed * 1_000_003 + p["index"]) % 2**32 for p in mine],
        )  # fmt: skip
        results = score_groups(pool, mine, completions)
        rewards = np.asarray([r.score for r in results], np.float32).reshape(-1, c.samples)
    if not several:
        return completions, rewards
    label = f"prompts {batch[0]['index']}-{batch[-1]['index']} x {c.samples}"
    return gather_groups(completions, rewards, len(batch), c.samples, channel="curate", label=label)


def _writer(out: str):
    """The output's writer: process 0's (the others' records are the same: they write none)."""
    return RecordWriter(out) if jax.process_index() == 0 else contextlib.nullcontext(_Discard())


class _Discard:
    def write(self, record) -> None:
        del record


def _with_end(stream: Iterator[dict]) -> Iterator[dict | None]:
    yield from stream
    yield None


def _output(record: dict, domain: str, **fields) -> dict:
    """A written record: the prompt record's fields (its verifier fields stay, for evals and
    later rounds) with `fields` set."""
    kept = {k: v for k, v in record.items() if k not in _OUTPUT_FIELDS}
    return {**kept, "domain": domain, **fields}


def _distinct(group: list[Completion], rewards: np.ndarray) -> list[tuple[str, float, bool]]:
    """(text, reward, ended with EOS) of a group's distinct non-empty texts, in sample order."""
    seen, out = set(), []
    for sample, reward in zip(group, rewards, strict=True):
        text = sample.text.strip()
        if text and text not in seen:
            seen.add(text)
            out.append((text, float(reward), sample.finish_reason == "stop"))
    return out


def make_pairs(
    model, tokenizer, sources: Sequence[tuple[str, str]], out: str, c: SampleConfig, *,
    min_margin: float = 0.0, per_prompt: int = 1, require_end: bool = True,
    progress: bool = True,
) -> dict:  # fmt: skip
    """Writes on-policy preference pairs to `out` and returns their counts.

    For each prompt, its distinct completions are ranked by reward (ties: sample order); the
    k-th best completion that ended with EOS (any, without `require_end`) is chosen against the
    k-th worst, for k up to `per_prompt`, while the margin (chosen reward - rejected reward)
    is above `min_margin` and above 0. A pair record is the prompt record with "chosen", "rejected",
    "chosen_reward", "rejected_reward" and "margin"; DPO reads it as it is.

    Returns:
      {"read", "malformed", "overlong", "prompts", "pairs", "no_signal" (every sample the
      same reward), "no_finished" (no chosen candidate ended), "below_margin", "mean_reward"
      (of all samples: the checkpoint's on-policy score), "pass_rate" (samples reaching
      rewards.pass_threshold), "mean_margin", "errors"}.
    """
    if c.samples < 2:
        raise ConfigError("pairs need samples >= 2 per prompt (a chosen and a rejected)")
    if per_prompt < 1 or min_margin < 0:
        raise ConfigError("per_prompt must be >= 1 and min_margin >= 0")
    counts: dict = {"pairs": 0, "no_signal": 0, "no_finished": 0, "below_margin": 0}
    margins: list[float] = []
    with _writer(out) as writer:
        for prompt, group, rewards in scored_groups(
            model, tokenizer, sources, c, counts, progress=progress, desc="pairs"
        ):
            texts = _distinct(group, rewards)
            if len({r for _, r, _ in texts}) < 2:
                counts["no_signal"] += 1
                continue
            order = sorted(range(len(texts)), key=lambda i: -texts[i][1])
            chosen = [texts[i] for i in order if texts[i][2] or not require_end]
            rejected = [texts[i] for i in reversed(order)]
            if not chosen:
                counts["no_finished"] += 1
                continue
            kept = 0
            for good, bad in zip(chosen[:per_prompt], rejected[:per_prompt], strict=False):
                margin = good[1] - bad[1]
                if margin <= max(min_margin, 0.0):
                    break
                writer.write(
                    _output(
                        prompt["record"],
                        prompt["domain"],
                        prompt=prompt["record"]["prompt"],
                        chosen=good[0],
                        rejected=bad[0],
                        chosen_reward=good[1],
                        rejected_reward=bad[1],
                        margin=margin,
                    )
                )
                margins.append(margin)
                kept += 1
            counts["pairs"] += kept
            counts["below_margin"] += kept == 0
        return _summary(counts, mean_margin=_mean(margins))


def synthesize(
    model, tokenizer, sources: Sequence[tuple[str, str]], out: str, c: SampleConfig, *,
    threshold: float | None = None, per_prompt: int = 1, require_end: bool = True,
    progress: bool = True,
) -> dict:  # fmt: skip
    """Rejection-sampled SFT data: writes to `out` up to `per_prompt` distinct completions of
    each prompt that ended with EOS (any, without `require_end`) and reached `threshold` (default
    `c.rewards.pass_threshold`), best first, as {"prompt", "completion", "reward", ...the prompt
    record's other fields}; returns the counts ("kept", "prompts_kept": prompts with at least
    one, "mean_reward", "pass_rate", "read", "malformed", "overlong", "prompts", "errors")."""
    if per_prompt < 1:
        raise ConfigError("per_prompt must be >= 1")
    threshold = c.rewards.pass_threshold if threshold is None else threshold
    counts: dict = {"kept": 0, "prompts_kept": 0}
    with _writer(out) as writer:
        for prompt, group, rewards in scored_groups(
            model, tokenizer, sources, c, counts, progress=progress, desc="synth"
        ):
            ended = [t for t in _distinct(group, rewards) if t[2] or not require_end]
            good = [t for t in ended if t[1] >= threshold]
            good.sort(key=lambda t: -t[1])  # (stable: sample order among equal rewards)
            for text, reward, _ in good[:per_prompt]:
                writer.write(
                    _output(
                        prompt["record"],
                        prompt["domain"],
                        prompt=prompt["record"]["prompt"],
                        completion=text,
                        reward=reward,
                    )
                )
            counts["kept"] += len(good[:per_prompt])
            counts["prompts_kept"] += bool(good)
        return _summary(counts)


def pass_rates(
    model, tokenizer, sources: Sequence[tuple[str, str]], c: SampleConfig, *,
    progress: bool = True,
) -> tuple[dict[int, float], dict]:  # fmt: skip
    """Each usable prompt's pass rate under the checkpoint: the share of its `c.samples`
    samples reaching `c.rewards.pass_threshold`, keyed by the record's position in `sources`
    (what `stratify_records(pass_rates=...)` takes); and the counts."""
    counts, rates = {}, {}
    groups = scored_groups(
        model, tokenizer, sources, c, counts, progress=progress, desc="pass rate"
    )
    for prompt, _, rewards in groups:
        rates[prompt["position"]] = float(np.mean(rewards >= c.rewards.pass_threshold))
    return rates, counts


def _mean(values) -> float:
    return float(np.mean(values)) if len(values) else 0.0


def _summary(counts: dict, **extra) -> dict:
    """The counts with the sample means; no usable prompt raises (the writer then leaves no
    file)."""
    if not counts["prompts"]:
        raise ConfigError(
            f"no usable prompt: read {counts['read']} records, {counts['malformed']} malformed, "
            f"{counts['overlong']} over max_prompt_len; first errors: {counts['errors'][:3]}"
        )
    kept = {k: v for k, v in counts.items() if k not in ("samples", "passed", "reward_sum")}
    return {
        **kept,
        "mean_reward": counts["reward_sum"] / max(counts["samples"], 1),
        "pass_rate": counts["passed"] / max(counts["samples"], 1),
        **extra,
    }
