"""A trained reward model as a reward function: the `"rm:<path>[#<head>]"` registry terms.

A `ModelReward` holds only the model's directory and an optional head name, so it pickles
cheaply; the model itself is loaded on first use, once per process, by `load_reward_model`
(`_reward_model.py`, imported then: it brings jax). `RewardPool` keeps
these terms out of its worker processes (each would load the model onto the accelerator) and
scores them in the trainer's process, one batched call per reference.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from posttrain import paths

PREFIX = "rm:"


def is_model_ref(fn: object) -> bool:
    """Whether a registered reward reference names a reward model ("rm:<path>[#<head>]")."""
    return isinstance(fn, str) and fn.startswith(PREFIX)


def parse_model_ref(ref: str) -> tuple[str, str | None]:
    """(absolute model directory, head or None) of an "rm:<path>[#<head>]" reference.

    Raises:
      ValueError: no path or an empty head.
    """
    if not is_model_ref(ref):
        raise ValueError(f"a reward model reference reads 'rm:<path>[#<head>]', got {ref!r}")
    path, sep, head = ref[len(PREFIX) :].rpartition("#")
    if not sep or "/" in head:  # no head; a '#' inside a directory name is part of the path
        path, head = ref[len(PREFIX) :], None
    if not path:
        raise ValueError(f"reward model reference {ref!r} has no path; write 'rm:<path>'")
    if head == "":
        raise ValueError(f"reward model reference {ref!r} has an empty head after '#'")
    return str(paths.path(path)), head  # local (absolute) or gs://


@dataclass(frozen=True)
class ModelReward:
    """Scores completions with a trained reward model's scalar head.

    The head of a record is the reference's explicit `#<head>`, else the head named like the
    record's domain, else the model's only head.
    """

    path: str  # the reward model's directory, as `load_reward_model` takes it
    head: str | None = None  # the head to score with; None picks one per domain

    @classmethod
    def from_ref(cls, ref: str) -> ModelReward:
        """The `ModelReward` of an "rm:<path>[#<head>]" reference."""
        return cls(*parse_model_ref(ref))

    def __call__(self, record: Mapping, completion: str) -> tuple[float, dict]:
        """Scores one completion, with the head of `record["domain"]`."""
        domain = record.get("domain") if isinstance(record, Mapping) else None
        return self.score_batch([record], [completion], [domain])[0]

    def score_batch(
        self,
        records: Sequence[Mapping],
        completions: Sequence[str],
        domains: Sequence[str | None],
    ) -> list[tuple[float, dict]]:
        """Scores many completions in one call of the model.

        Args:
          records: prompt records; each needs a "prompt" (a string or chat messages).
          completions: one generated text per record.
          domains: the domain each record is scored for (picks its head).

        Returns:
          One (score, {"head": head}) per record, in input order.

        Raises:
          ValueError: mismatched lengths, a record without a prompt, a domain for which no head
            can be picked, or a model that returns the wrong number of scores.
        """
        if not len(records) == len(completions) == len(domains):
            raise ValueError(
                f"{len(records)} records, {len(completions)} completions and {len(domains)} "
                "domains to score with a reward model"
            )
        if not records:
            return []
        prompts = [_prompt(r) for r in records]
        model = _load(self.path)
        heads = [self.pick_head(tuple(model.heads), d) for d in domains]
        scores_N = np.asarray(model.score(prompts, list(completions), heads), np.float32)
        if scores_N.shape != (len(records),):
            raise ValueError(
                f"reward model {self.path!r} returned scores of shape {scores_N.shape} for "
                f"{len(records)} completions"
            )
        return [(float(s), {"head": h}) for s, h in zip(scores_N, heads, strict=True)]

    def check(self, domain: str | None) -> str:
        """Loads the model (once per process); the head that scores `domain`, or a ValueError."""
        return self.pick_head(tuple(_load(self.path).heads), domain)

    def pick_head(self, heads: tuple[str, ...], domain: str | None) -> str:
        """The head that scores `domain`: explicit, else named like the domain, else the only one.

        Raises:
          ValueError: names the domain, the model's heads and how to pick one.
        """
        if self.head is not None:
            if self.head not in heads:
                raise ValueError(
                    f"reward model {self.path!r} has no head {self.head!r}; its heads: "
                    f"{', '.join(heads) or 'none'}"
                )
            return self.head
        if domain in heads:
            return domain
        if len(heads) == 1:
            return heads[0]
        raise ValueError(
            f"reward model {self.path!r} has heads {', '.join(heads) or 'none'}, none named like "
            f"domain {domain!r}; pick one by registering 'rm:{self.path}#<head>'"
        )


def check_model_ref(ref: str) -> str:
    """The normalised form of an "rm:" reference, after checking that its directory exists.

    Raises:
      ValueError: a malformed reference or a missing directory.
    """
    path, head = parse_model_ref(ref)
    if not paths.path(path).is_dir():
        raise ValueError(
            f"reward model directory {path!r} (from {ref!r}) does not exist or is not a "
            "directory; point 'rm:<path>' at a trained reward model's output directory"
        )
    return PREFIX + path + ("" if head is None else f"#{head}")


@functools.cache
def _load(path: str):
    """The reward model at `path` (`load_reward_model`), loaded once per process."""
    from posttrain.rewards._reward_model import load_reward_model  # imports jax: on first use

    return load_reward_model(path)


def _prompt(record: Mapping) -> str | list:
    """The prompt a reward model scores a completion against: a string or chat messages."""
    prompt = record.get("prompt") if isinstance(record, Mapping) else None
    if not isinstance(prompt, str | list):
        got = "no 'prompt'" if prompt is None else f"prompt {prompt!r:.100}"
        raise ValueError(
            "a reward model scores a completion against its record's 'prompt' (a string or "
            f"chat messages), but this record has {got}: {record!r:.200}"
        )
    return prompt
