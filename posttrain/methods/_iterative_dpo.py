"""Iterative (online) DPO: rounds of on-policy pairs and DPO, each round from the last one's
policy (method "iterative_dpo", configs/dpo.py:iterative).

Round r samples pairs from its starting policy (`model` for round 0, round r-1's final
checkpoint after) on prompts of `data.sources` (records with a prompt and what their reward
domain reads), then trains DPO on them in `<workdir>/round_<r>` with that policy as the
reference. A round whose pairs file exists reuses it; a finished round is skipped; a preempted
one resumes: a rerun of the same command goes on where the last one stopped.
"""

from __future__ import annotations

import dataclasses
import json
import logging

from posttrain import paths
from posttrain.config import ConfigError
from posttrain.curate import SampleConfig, make_pairs
from posttrain.data import SourceConfig, load_tokenizer
from posttrain.lora import load_model_and_tokenizer
from posttrain.methods._dpo import DPO, DPOConfig, run_dpo
from posttrain.models import ModelSpec, finished_step

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PairsConfig(SampleConfig):
    """The rounds and how each samples its pairs (every `SampleConfig` field, plus these).

    `limit` is the prompts of one round; round r starts at prompt `offset + r * limit` (no
    wrapping: give enough prompts; `limit=0`: every round samples all of them), with seed
    `seed + r`."""

    rounds: int = 2
    min_margin: float = 0.0  # keep pairs whose reward margin is above this
    per_prompt: int = 1  # pairs per prompt at most (k-th best vs k-th worst)

    def __post_init__(self):
        super().__post_init__()
        if self.rounds < 1:
            raise ConfigError(f"pairs.rounds must be >= 1, got {self.rounds}")


@dataclasses.dataclass(frozen=True)
class IterativeDPOConfig(DPOConfig):
    """A DPO run in rounds of on-policy pairs; `data.sources` are prompt records here, and
    `train.steps` are the steps of each round."""

    pairs: PairsConfig = PairsConfig()

    def __post_init__(self):
        super().__post_init__()
        if not (self.model.checkpoint or self.model.hf_path):
            raise ConfigError(
                "iterative DPO samples its first pairs from model.checkpoint or model.hf_path; "
                "set one (e.g. an SFT run's workdir)"
            )


def _policy(c: IterativeDPOConfig, start: ModelSpec):
    """(model, tokenizer) of a round's starting policy."""
    model, tokenizer = load_model_and_tokenizer(start.checkpoint or start.hf_path)
    return model, (load_tokenizer(c.tokenizer) if c.tokenizer else tokenizer)


def run_iterative_dpo(c: IterativeDPOConfig, workdir: str, *, on_metrics=None) -> dict:
    """Runs (or resumes) the rounds in `workdir`; returns the last round's DPO summary with
    "rounds": one dict per round (its pairs' counts and the DPO run's end) and "workdir": the
    last round's directory (where the final policy is)."""
    p = c.pairs
    sources = [(s.path, s.domain) for s in c.data.sources]
    start, summary, rounds = c.model, {}, []
    for r in range(p.rounds):
        round_dir = paths.join(workdir, f"round_{r}")
        pairs_path = paths.join(round_dir, "pairs.jsonl")
        stats_path = paths.path(round_dir) / "pairs.json"
        if not stats_path.exists():
            model, tokenizer = _policy(c, start)
            sampling = dataclasses.replace(p, offset=p.offset + r * p.limit, seed=p.seed + r)
            stats = make_pairs(
                model, tokenizer, sources, pairs_path, sampling,
                min_margin=p.min_margin, per_prompt=p.per_prompt, progress=c.train.progress,
            )  # fmt: skip
            paths.write_text(stats_path, json.dumps(stats, indent=2))
            del model
        stats = json.loads(stats_path.read_text())
        log.info(
            "round %d: %d pairs from %d prompts (on-policy reward %.3f)",
            r, stats["pairs"], stats["prompts"], stats["mean_reward"],
        )  # fmt: skip
        if not stats["pairs"]:
            raise ConfigError(
                f"round {r} found no pair in {stats['prompts']} prompts: every prompt's samples "
                f"scored alike ({stats['no_signal']}) or none ended ({stats['no_finished']}); "
                "raise pairs.samples or pairs.sampling.temperature, or use harder prompts"
            )
        domain = c.data.sources[0].domain
        round_config = dataclasses.replace(
            c,
            model=start,
            data=dataclasses.replace(c.data, sources=(SourceConfig(pairs_path, domain=domain),)),
            train=dataclasses.replace(c.train, seed=c.train.seed + r),
        )
        if finished_step(round_dir) >= c.train.steps:
            log.info("round %d already finished in %s: reusing it", r, round_dir)
            summary = {"stopped": "completed", "final_step": c.train.steps}
        else:
            summary = run_dpo(_as_dpo(round_config), round_dir, on_metrics=on_metrics)
        rounds.append({"round": r, **stats, "stopped": summary["stopped"]})
        if summary["stopped"] == "preempted":  # saved mid-round: a rerun resumes it
            break
        start = ModelSpec(checkpoint=round_dir, **c.model.overrides())
    paths.write_text(paths.join(workdir, "rounds.json"), json.dumps(rounds, indent=2))
    return {**summary, "rounds": rounds, "workdir": round_dir}


def _as_dpo(c: IterativeDPOConfig) -> DPOConfig:
    """The plain DPO config of a round (its checkpoints record a DPO run)."""
    fields = {f.name: getattr(c, f.name) for f in dataclasses.fields(DPOConfig)}
    return DPOConfig(**fields)


# Each round's step is DPO's: the same plan, frozen inputs and batch.
ITERATIVE_DPO = dataclasses.replace(
    DPO, name="iterative_dpo", config=IterativeDPOConfig, run=run_iterative_dpo
)
