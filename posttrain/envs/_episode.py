"""An episode as the RL layer receives it (`Episode`), its budgets (`Budget`), how one can end
(`FINISH_REASONS`) and the metrics over a step's episodes (`episode_metrics`); the loop that
runs them is `_episodes.run_episodes`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

FINISH_REASONS = ("stop", "length", "turns", "tool_time", "error")


@dataclasses.dataclass(frozen=True)
class Budget:
    """Per-episode limits; an episode that reaches one ends as truncated."""

    max_turns: int = 8  # model turns
    max_tokens: int = 1024  # sampled + observation tokens after the prompt
    turn_tokens: int = 256  # sampled tokens per turn
    max_tool_s: float = 120.0  # seconds the episode's tool calls may take in all

    def __post_init__(self):
        if min(self.max_turns, self.max_tokens, self.turn_tokens) < 1 or self.max_tool_s <= 0:
            raise ValueError(f"episode budgets must be positive, got {self}")


@dataclasses.dataclass
class Episode:
    """One finished episode.

    Attributes:
      record: the prompt record it was made from.
      prompt_ids: the opening messages rendered with the tools and the generation prompt.
      token_ids: everything after the prompt: sampled tokens and observation tokens.
      logprobs: the sampler's log-prob of each sampled token (0.0 on observation tokens).
      mask: 1 on sampled tokens (the policy's), 0 on observation tokens.
      messages: the conversation (opening messages, the model's parsed turns, observations).
      reward: the environment's reward; None to score `text` with the record's reward domain.
      finish_reason: "stop" (the environment ended it), "length" (a token budget), "turns",
        "tool_time" (budgets) or "error" (the environment raised; reward 0).
      text: the model's last turn's text (what a reward domain scores).
      turns, tool_calls, tool_errors, tool_s: counts; recovered: a tool error was followed
        by a successful call or the final answer.
      turn_rewards: per-turn rewards the environment reported (`info["turn_reward"]`).
      tools: the tool schemas the prompt rendered (for SFT on the episode's messages).
      counts: the environment's own numbers (`Step.info`'s other keys, summed over turns: the
        clarify environment's `questions`), `episode/<name>` in the metrics.
    """

    record: dict
    prompt_ids: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    messages: list[dict] = dataclasses.field(default_factory=list)
    reward: float | None = None
    finish_reason: str = ""
    text: str = ""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_s: float = 0.0
    recovered: bool = False
    turn_rewards: list[float] = dataclasses.field(default_factory=list)
    tools: list[dict] | None = None
    counts: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def truncated(self) -> bool:
        return self.finish_reason not in ("stop", "error")


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Host metrics over episodes: turns, tool calls and error rate, recovery, truncation, and
    the means of the environments' own counts."""
    if not episodes:
        return {}
    calls = sum(e.tool_calls for e in episodes)
    errors = sum(e.tool_errors for e in episodes)
    erred = [e for e in episodes if e.tool_errors]
    out = {
        "episode/turns": float(np.mean([e.turns for e in episodes])),
        "episode/tool_calls": calls / len(episodes),
        "episode/tool_error_rate": errors / max(calls, 1),
        "episode/recovery_rate": (
            sum(e.recovered for e in erred) / len(erred) if erred else float("nan")
        ),
        "episode/truncated": float(np.mean([e.truncated for e in episodes])),
        "episode/tool_s": float(np.mean([e.tool_s for e in episodes])),
        "episode/tokens": float(np.mean([len(e.token_ids) for e in episodes])),
    }
    for reason in FINISH_REASONS[1:]:
        out[f"episode/ended_{reason}"] = float(
            np.mean([e.finish_reason == reason for e in episodes])
        )
    for name in sorted({k for e in episodes for k in e.counts}):  # (absent: 0)
        if f"episode/{name}" not in out:  # (the loop's own metrics keep their meaning)
            out[f"episode/{name}"] = float(np.mean([e.counts.get(name, 0.0) for e in episodes]))
    return out
