"""RL prompts: records with a `prompt` (and verifier fields) -> this process's prompt batches.

A record is `{"prompt": str or messages, "domain": str, ...}` plus whatever its domain's reward
functions read (`answer`, `tests`, `schema`...). Each process encodes its share of every source
(`records[pi::pc]`) once at startup, counting records it cannot use; a Grain graph then draws
prompts (sources mixed by weight, reshuffled every epoch) and its position is saved with every
checkpoint, so a resumed run sees the same prompts in the same order.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from posttrain.data import (
    TEXT_KEYS,
    DataConfig,
    ImageRecordError,
    ImageSpec,
    RecordError,
    Records,
    Tokenizer,
    canonical_identity,
    config_identity,
    decode,
    encode_prompt,
    fit_prompt,
    flatten_record,
    has_images,
    image_root,
    index_mixture,
    process_share,
    source_names,
)

_log = logging.getLogger(__name__)
_KEPT_ERRORS = 10


@dataclasses.dataclass(frozen=True)
class AdaptiveDomains:
    """Domain weights that follow the learning signal: weight_d = base_d x (floor + signal_d),
    signal_d an exponential average (`smoothing`) of the share of domain d's groups whose
    rewards still differ. base_d comes from the sources' weights."""

    smoothing: float = 0.9
    floor: float = 0.1  # keeps every domain sampled a little, so its signal is still measured


def _place_images(record, images: ImageSpec | None) -> tuple[dict, list]:
    """The record with its images as image tokens, and their refs (`flatten_record`)."""
    if images is None:
        if has_images(record, TEXT_KEYS):
            raise RecordError("the prompt has images, but the model has no vision tower")
        return record, []
    flat, refs = flatten_record(record, images, TEXT_KEYS)
    if len(refs) > images.max_images:
        raise RecordError(f"{len(refs)} images, more than the {images.max_images} a row holds")
    return flat, refs


class PromptData:
    """This process's stream of RL prompt batches; each batch is a list of `rows` prompts.

    A prompt is `{"record": the decoded record, "prompt_ids": list[int], "domain": str,
    "domain_id": int}`; the record's own "domain" wins over its source's. With `images` (a
    VLM's `ImageSpec`) a prompt may place images (`posttrain.data._image_chat`): it then has
    "images" (their refs, read when it is sampled: `prompt_pixels`) and "image_root".

    `grouped`: every batch holds prompts of one domain, drawn by the domains' weights (the
    sources' weights, or the adaptive ones), so each update sees one domain.

    Attributes:
      domains: the domain names, in order of first appearance (sources, then records).
      rows: prompts per batch on this process (`data.batch_size // process_count`).
      stats: read, used, malformed (no usable prompt), overlong (prompt over max_prompt_len),
        per-domain prompt counts and the first error messages.
    """

    def __init__(
        self,
        config: DataConfig,
        tokenizer: Tokenizer,
        *,
        max_prompt_len: int,
        adaptive: AdaptiveDomains | None = None,
        grouped: bool = False,
        process_index: int | None = None,
        process_count: int | None = None,
        images: ImageSpec | None = None,
        fit_documents: Mapping[str, int] | None = None,
    ):
        pi, pc, tokenizer = process_share(config, tokenizer, process_index, process_count)
        fit_documents = dict(fit_documents or {})
        self.rows = config.batch_size // pc
        counts = dict.fromkeys(("read", "used", "malformed", "overlong", "fitted"), 0)
        errors: list[str] = []
        self.prompts: list[dict[str, Any]] = []
        members: list[list[int]] = []
        records = [Records.of(s) for s in config.sources]
        for source, recs in zip(config.sources, records, strict=True):
            members.append([])
            for i in range(pi, len(recs), pc):
                raw, where = recs[i]
                counts["read"] += 1
                try:
                    record = decode(raw)
                    flat, refs = _place_images(record, images)
                    ids = encode_prompt(flat, tokenizer)
                    if not ids:
                        raise RecordError("the prompt encodes to no token")
                    domain = record.get("domain", source.domain)
                    if not isinstance(domain, str) or not domain:
                        raise RecordError(f"'domain' must be a non-empty string, got {domain!r}")
                except (RecordError, ImageRecordError) as e:
                    if config.on_error == "raise":
                        raise RecordError(
                            f"{where}: {e}. Fix the record, or set data.on_error='skip' to skip "
                            "and count bad prompts."
                        ) from None
                    counts["malformed"] += 1
                    if len(errors) < _KEPT_ERRORS:
                        errors.append(f"{where}: {e}")
                    continue
                budget = min(fit_documents.get(domain, max_prompt_len), max_prompt_len)
                if len(ids) > budget and domain in fit_documents and not refs:
                    fitted = fit_prompt(record, tokenizer, budget)
                    if fitted is not None:  # dynamic truncation: the relevant passages
                        record, ids = fitted, encode_prompt(fitted, tokenizer)
                        counts["fitted"] += 1
                if len(ids) > budget:
                    counts["overlong"] += 1
                    continue
                counts["used"] += 1
                members[-1].append(len(self.prompts))
                prompt = {"record": record, "prompt_ids": ids, "domain": domain}
                if refs:
                    prompt |= {"images": refs, "image_root": image_root(source.path)}
                self.prompts.append(prompt)
        if not all(members):
            empty = [s.path for s, m in zip(config.sources, members, strict=True) if not m]
            raise ValueError(
                f"no usable prompt in source(s) {empty} on this process (counts {counts}; a "
                f"prompt must fit rollout.max_prompt_len={max_prompt_len}); first errors: "
                f"{errors[:3]}"
            )
        if skipped := {k: counts[k] for k in ("malformed", "overlong") if counts[k]}:
            _log.warning("left out %s of %d prompt records", skipped, counts["read"])
        named = [s.domain for s in config.sources]
        found = [p["domain"] for p in self.prompts]
        self.domains = tuple(dict.fromkeys([*named, *found]))
        per_domain = dict.fromkeys(self.domains, 0)
        for p in self.prompts:
            p["domain_id"] = self.domains.index(p["domain"])
            per_domain[p["domain"]] += 1
        self.stats = {**counts, "domains": per_domain, "errors": errors}
        fields = config_identity(config)
        self._identity = {
            "config": fields,
            "max_prompt_len": max_prompt_len,
            "process": [pi, pc],
            "records": [len(r) for r in records],
            "adaptive": adaptive and dataclasses.asdict(adaptive),
            "grouped": grouped,
        }
        self._config, self._members, self.adaptive = config, members, adaptive
        self.grouped = grouped
        self._lock = threading.Lock()
        self._build()

    def _build(self) -> None:
        """The index streams over the kept prompts (again after `keep`)."""
        c, members = self._config, self._members
        self._identity["prompts"] = sum(map(len, members))
        self._identity = canonical_identity(self._identity)
        if self.adaptive is None and not self.grouped:
            indices = index_mixture(
                members,
                [s.weight for s in c.sources],
                seed=c.seed,
                shuffle=c.shuffle,
                num_epochs=c.num_epochs,
                curriculum=c.curriculum,  # phases in steps: prompt batches drawn
                names=source_names([s.path for s in c.sources]),
                rows=self.rows,
            )
            self._iterator = indices.batch(
                self.rows, batch_fn=lambda idx: [self.prompts[i] for i in idx]
            ).__iter__()
            return
        if c.num_epochs is not None:
            raise ValueError(
                "adaptive domain weights and grouped domain batches need data.num_epochs=None "
                "(repeat forever)"
            )
        # One endless stream per domain; each prompt's domain (grouped: each batch's) drawn by
        # the current weights.
        by_domain = [[i for m in members for i in m if self.prompts[i]["domain_id"] == d]
                     for d in range(len(self.domains))]  # fmt: skip
        self._streams = {
            d: index_mixture([m], [1.0], seed=c.seed + 7919 * (d + 1), shuffle=c.shuffle,
                             num_epochs=None).__iter__()
            for d, m in enumerate(by_domain) if m
        }  # fmt: skip
        base = np.zeros(len(self.domains))
        total = sum(map(len, members))
        for source, m in zip(c.sources, members, strict=True):
            for i in m:
                base[self.prompts[i]["domain_id"]] += source.weight / len(m)
        self._base = base / max(base.sum(), 1e-12) if total else base
        self._signal = np.ones(len(self.domains))  # optimistic start: every domain learnable
        self._rng = np.random.default_rng(c.seed)

    @property
    def domain_weights(self) -> dict[str, float]:
        """The current sampling weight of each domain (adaptive or grouped mode)."""
        if self.adaptive is None and not self.grouped:
            return {}
        if self.adaptive is None:
            return dict(zip(self.domains, self._base.tolist(), strict=True))
        w = self._base * (self.adaptive.floor + self._signal)
        w = w / w.sum()
        return dict(zip(self.domains, w.tolist(), strict=True))

    def update_signal(self, signal: dict[str, float]) -> None:
        """Adaptive mode: folds this step's learning signal per domain (e.g. the share of its
        groups whose rewards differ) into the running estimate that sets the weights."""
        if self.adaptive is None:
            return
        with self._lock:
            for name, value in signal.items():
                d = self.domains.index(name)
                a = self.adaptive.smoothing
                self._signal[d] = a * self._signal[d] + (1 - a) * value

    def __iter__(self) -> PromptData:
        return self

    def __next__(self) -> list[dict[str, Any]]:
        if self.adaptive is None and not self.grouped:
            return next(self._iterator)
        with self._lock:
            w = np.asarray(list(self.domain_weights.values()))
            live = [d for d in range(len(w)) if d in self._streams]
            p = w[live] / w[live].sum()
            picks = self._rng.choice(live, size=1 if self.grouped else self.rows, p=p)
            picks = np.repeat(picks, self.rows // len(picks))
            return [self.prompts[next(self._streams[int(d)])] for d in picks]

    def get_state(self) -> dict[str, Any]:
        """The position (JSON-serialisable), saved with every checkpoint."""
        if self.adaptive is None and not self.grouped:
            return {"pipeline": self._identity, "iterator": self._iterator.get_state()}
        with self._lock:
            return json.loads(
                json.dumps(
                    {
                        "pipeline": self._identity,
                        "streams": {str(d): it.get_state() for d, it in self._streams.items()},
                        "rng": self._rng.bit_generator.state,
                        "signal": self._signal.tolist(),
                    }
                )
            )

    def set_state(self, state: dict[str, Any]) -> None:
        """Resumes at a `get_state()` position.

        Raises:
          ValueError: the state was saved with other prompts, config or processes.
        """
        if canonical_identity(state.get("pipeline", {})) != self._identity:
            raise ValueError(
                "the prompt data state was saved by a different pipeline (saved "
                f"{state.get('pipeline')}, now {self._identity}); resume with the same data "
                "config, process layout and data files, or start afresh"
            )
        if self.adaptive is None and not self.grouped:
            self._iterator.set_state(state["iterator"])
            return
        for d, it in self._streams.items():
            it.set_state(state["streams"][str(d)])
        self._rng.bit_generator.state = state["rng"]
        self._signal = np.asarray(state["signal"], np.float64)

    def keep(self, indices) -> None:
        """Keeps only these prompts (indices into `prompts`), e.g. after difficulty filtering.

        Raises:
          ValueError: a source would have no prompt left.
        """
        keep = set(indices)
        members = [[i for i in m if i in keep] for m in self._members]
        if not all(members):
            raise ValueError(
                "difficulty filtering left a data source with no prompt; widen "
                "difficulty.min_pass_rate / max_pass_rate or add prompts"
            )
        self._members = members
        self._identity["kept"] = sum(map(len, members))
        self._build()

    def lengths(self) -> np.ndarray:
        """Prompt lengths in tokens (for sizing buffers)."""
        return np.asarray([len(p["prompt_ids"]) for p in self.prompts])
