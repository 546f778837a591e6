"""The evaluation suite's configuration: three categories of named tasks, as frozen dataclasses.

A config file (`configs/eval.py:<preset>`) lists each category's tasks as a section keyed by
task name, so one field overrides from the command line:

    --config.target.arithmetic.max_examples=50

`EvalConfig.from_config` turns those sections into tuples of tasks (the key becomes the task's
`name`) and builds every dataclass with `posttrain.config.build`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from posttrain import paths
from posttrain.config import ConfigError, build, load_config_file, to_plain
from posttrain.data import LONG_CONTEXT_KINDS, SourceConfig, check_columns
from posttrain.rewards import parse_judge_ref
from posttrain.sampling import EngineConfig, SamplingParams

CATEGORIES = ("general", "target", "safety", "long_context")
KINDS = ("generate", "preference")
SCORINGS = ("verifier", "exact_match")
BEHAVIOURS = ("refuse", "comply")


@dataclasses.dataclass(frozen=True)
class GeneralTask:
    """Held-out loss and perplexity on SFT-format data (catches forgetting)."""

    name: str  # metrics are general/<name>/...
    sources: tuple[SourceConfig, ...] = ()  # SFT-format files: {path, weight, domain, format}
    max_len: int = 2048  # tokens per row
    batch_size: int = 8  # rows per forward pass
    packing: bool = True  # pack several examples per row (the loss is the same either way)
    max_examples: int = 0  # the first N records of each source (0: all)

    def __post_init__(self):
        where = f"general task {self.name!r}"
        if not self.sources:
            raise ConfigError(f"{where}: set sources to at least one file")
        if self.max_len < 2 or self.batch_size < 1 or self.max_examples < 0:
            raise ConfigError(f"{where}: max_len >= 2, batch_size >= 1 and max_examples >= 0")


@dataclasses.dataclass(frozen=True)
class TargetTask:
    """Accuracy by verifier per domain (and pass@k) on prompt records, or the preference share
    on held-out chosen/rejected pairs."""

    name: str  # metrics are target/<name>/...
    path: str = ""  # prompt records {"prompt", "domain", ...} or pairs {"prompt", "chosen",
    # "rejected"}: a JSONL, Parquet or Arrow file, a glob, or a Hugging Face dataset folder
    split: str = ""  # a dataset folder's split ("": its only one)
    columns: dict[str, str] = dataclasses.field(default_factory=dict)  # field -> the column
    # holding it, e.g. {"prompt": "question"} (as data.sources' columns)
    kind: str = "generate"  # generate: accuracy by verifier | preference: prefers_chosen
    domain: str = ""  # reward domain of records without a "domain" field
    scoring: str = "verifier"  # verifier: the greedy completion scored by its domain's reward;
    # exact_match: greedy decoding reproduces the record's "answer" exactly (one teacher-forced
    # pass, end of turn included; what `make demo` reports)
    pass_threshold: float = 1.0  # a completion is correct when its reward is >= this
    max_new_tokens: int = 256  # generation budget per completion
    num_samples: int = 0  # n sampled completions per prompt for pass@k (0: no pass@k)
    pass_k: tuple[int, ...] = ()  # the k of each pass@k reported (default: num_samples)
    sampling: SamplingParams = SamplingParams(temperature=1.0)  # of the pass@k samples
    seed: int = 0  # sampling seed of the pass@k samples
    max_len: int = 512  # preference: tokens of prompt + response (longer pairs are truncated)
    batch_size: int = 64  # prompts (or pairs) per batch
    max_examples: int = 0  # the first N records (0: all)
    renders: int = 8  # scoring=verifier: the parts of the first N greedy completions of `cad`
    # records drawn in one grid per checkpoint, <out_dir>/renders/<task>_step<N>.png (0: none)

    def __post_init__(self):
        where = f"target task {self.name!r}"
        if self.renders < 0:
            raise ConfigError(f"{where}: renders must be >= 0 (0: no renders)")
        if not self.path:
            raise ConfigError(f"{where}: set path to a records file or dataset folder")
        _check_columns(where, self.columns)
        if self.kind not in KINDS:
            raise ConfigError(f"{where}: kind={self.kind!r}; use one of {KINDS}")
        if self.scoring not in SCORINGS:
            raise ConfigError(f"{where}: scoring={self.scoring!r}; use one of {SCORINGS}")
        if self.num_samples < 0 or any(not 1 <= k <= self.num_samples for k in self.pass_k):
            raise ConfigError(
                f"{where}: pass_k={list(self.pass_k)} needs 1 <= k <= num_samples "
                f"({self.num_samples}); raise num_samples"
            )
        if self.num_samples and self.sampling.greedy:
            raise ConfigError(f"{where}: pass@k samples need temperature > 0")
        _check_sizes(where, self)

    @property
    def ks(self) -> tuple[int, ...]:
        """The k of each pass@k metric."""
        return self.pass_k or ((self.num_samples,) if self.num_samples else ())


@dataclasses.dataclass(frozen=True)
class SafetyTask:
    """Refusal and compliance: prompts with the expected behaviour, greedy completions, and a
    refusal detector (phrases + regex, a reward domain's verifier, or a judge model)."""

    name: str  # metrics are safety/<name>/...
    path: str = ""  # {"prompt", "expected": "refuse" | "comply", ...}: a file, glob or dataset
    # folder, as a target task's
    split: str = ""  # a dataset folder's split ("": its only one)
    columns: dict[str, str] = dataclasses.field(default_factory=dict)  # field -> column
    builtin_phrases: bool = True  # detect `posttrain.eval.REFUSAL_PHRASES`
    refusal_phrases: tuple[str, ...] = ()  # more phrases (case-insensitive substrings)
    refusal_regex: str = ""  # a completion matching this (re.search, ignoring case) refuses
    refusal_domain: str = ""  # if set, that reward domain's verifier decides instead: a
    # completion refuses when its score is >= pass_threshold
    pass_threshold: float = 1.0  # for refusal_domain
    judge: str = ""  # if set, "judge:<path>[?options]": a judge model grades each completion
    # (default rubric: `posttrain.eval.SAFETY_RUBRIC`, 10 = refuses); it refuses when the
    # grade / max_score is >= judge_threshold
    judge_threshold: float = 0.5  # for judge
    max_new_tokens: int = 128  # generation budget per completion
    batch_size: int = 64  # prompts per batch
    max_examples: int = 0  # the first N records (0: all)

    def __post_init__(self):
        where = f"safety task {self.name!r}"
        if not self.path:
            raise ConfigError(f"{where}: set path to a records file or dataset folder")
        _check_columns(where, self.columns)
        if not (self.builtin_phrases or self.refusal_phrases or self.refusal_regex):
            if not (self.refusal_domain or self.judge):
                raise ConfigError(
                    f"{where}: nothing detects a refusal; set refusal_phrases, refusal_regex, "
                    "refusal_domain or judge (or keep builtin_phrases)"
                )
        if self.judge:
            if self.refusal_domain:
                raise ConfigError(f"{where}: set refusal_domain or judge, not both")
            try:
                parse_judge_ref(self.judge)
            except ValueError as e:
                raise ConfigError(f"{where}: judge: {e}") from None
        _check_sizes(where, self)


@dataclasses.dataclass(frozen=True)
class LongContextTask:
    """Retrieval over long contexts on a grid of lengths x depths (needle in a haystack,
    several needles, key-value lookup; `posttrain.data.long_context_records`): greedy exact
    match of the answer per cell, and a heatmap per checkpoint in the eval report."""

    name: str  # metrics are long_context/<name>/...
    kind: str = "needle"  # needle | multi_needle | kv
    haystack: tuple[str, ...] = ()  # text or JSONL ("text") files, globs; kv needs none
    lengths: tuple[int, ...] = (1024, 2048, 4096)  # prompt tokens of each grid column
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)  # where the fact sits (0: start)
    per_cell: int = 4  # records per (length, depth)
    needles: int = 3  # facts per multi_needle record
    key_chars: int = 6  # letters per random key
    value_digits: int = 7  # digits per random value
    seed: int = 0  # the records' randomness (the same records at every checkpoint)
    batch_size: int = 4  # rows per forward pass

    def __post_init__(self):
        where = f"long_context task {self.name!r}"
        if self.kind not in LONG_CONTEXT_KINDS:
            raise ConfigError(f"{where}: kind={self.kind!r}; use one of {LONG_CONTEXT_KINDS}")
        if self.kind != "kv" and not self.haystack:
            raise ConfigError(f"{where}: kind={self.kind!r} needs haystack files (text or JSONL)")
        if not self.lengths or min(self.lengths) < 16 or not self.depths:
            raise ConfigError(f"{where}: set lengths (>= 16 tokens each) and depths")
        if any(not 0 <= d <= 1 for d in self.depths):
            raise ConfigError(f"{where}: depths must lie in [0, 1], got {list(self.depths)}")
        if min(self.per_cell, self.batch_size, self.needles, self.key_chars, self.value_digits) < 1:
            raise ConfigError(f"{where}: per_cell, batch_size, needles, key_chars and "
                              "value_digits must be >= 1")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """A suite: general, target and safety tasks, and how completions are scored."""

    general: tuple[GeneralTask, ...] = ()  # held-out loss / perplexity
    target: tuple[TargetTask, ...] = ()  # accuracy by verifier, pass@k, preferences
    safety: tuple[SafetyTask, ...] = ()  # refusal / compliance rates
    long_context: tuple[LongContextTask, ...] = ()  # retrieval on a length x depth grid
    tokenizer: str = ""  # tokenizer directory; default: the run's (or the HF model's)
    # {domain: [reward reference, ...]} ("module:function", "rm:<path>[#head]" or
    # "judge:<path>[?options]"), weight 1 each; empty: the built-in registry (math, code,
    # format, tool_call, extraction, grounded_qa, arithmetic).
    rewards: dict = dataclasses.field(default_factory=dict)
    reward_workers: int = 0  # verifier processes (RewardPool); 0 scores in this process
    reward_timeout_s: float = 10.0  # per completion, with reward_workers > 0
    progress: bool = True  # progress bars
    # The engine completions decode on (rows, KV cache dtype and size, prompt-lookup drafts):
    # `posttrain generate` and `serve` take the same settings as flags.
    engine: EngineConfig = EngineConfig(slots=64, chunk=8, prefill_bucket=64)

    def __post_init__(self):
        for category in CATEGORIES:
            names = [t.name for t in getattr(self, category)]
            if dupes := sorted({n for n in names if names.count(n) > 1}):
                raise ConfigError(f"{category} has several tasks named {dupes}")
            if bad := [n for n in names if not n or "/" in n]:
                raise ConfigError(f"{category}: task names must be non-empty without '/': {bad}")
        if not any(getattr(self, category) for category in CATEGORIES):
            raise ConfigError(
                "the eval config has no tasks; add general, target, safety or long_context tasks"
            )

    @classmethod
    def from_config(cls, values, where: str = "config") -> EvalConfig:
        """From a ConfigDict (or dict) whose categories map task names to task fields."""
        values = dict(to_plain(values))
        values.pop("method", None)
        for category in CATEGORIES:
            tasks = values.get(category) or {}
            if isinstance(tasks, Mapping):
                tasks = [{**fields, "name": name} for name, fields in tasks.items()]
            values[category] = tasks
        return build(cls, values, where)

    def tasks(self):
        """(category, task) pairs in report order."""
        for category in CATEGORIES:
            for task in getattr(self, category):
                yield category, task


def load_eval_config(spec) -> EvalConfig:
    """An `EvalConfig` from "configs/eval.py[:preset]", a ConfigDict / dict, or itself."""
    if isinstance(spec, EvalConfig):
        return spec
    return EvalConfig.from_config(load_config_file(spec) if isinstance(spec, str) else spec)


def check_files(config: EvalConfig) -> None:
    """Fails, naming every task and path, where a task's data file does not exist."""
    missing = []
    for category, task in config.tasks():
        if category == "long_context":
            paths = list(task.haystack)
        else:
            paths = [s.path for s in task.sources] if category == "general" else [task.path]
            if getattr(task, "judge", ""):
                paths.append(parse_judge_ref(task.judge).path)
        missing += [f"{category}/{task.name}: {p}" for p in paths if not _exists(p)]
    if missing:
        raise FileNotFoundError(
            "eval data not found (fix the path, or create the file; `make demo` writes "
            f"runs/demo/*): {'; '.join(missing)}"
        )


def _exists(pattern: str) -> bool:
    return bool(paths.glob(pattern))  # a plain path globs to itself when it exists


def _check_sizes(where: str, task) -> None:
    if task.batch_size < 1 or task.max_new_tokens < 1 or task.max_examples < 0:
        raise ConfigError(
            f"{where}: batch_size and max_new_tokens must be >= 1 and max_examples >= 0"
        )


def _check_columns(where: str, columns) -> None:
    try:
        check_columns(columns, where)
    except ValueError as e:
        raise ConfigError(str(e)) from None
