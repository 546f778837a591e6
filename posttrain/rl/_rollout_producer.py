"""Decoupled rollouts: a thread that samples ahead of the trainer with the newest weights sent."""

from __future__ import annotations

import itertools
import queue
import threading

import jax
import numpy as np

from posttrain.lora import param_bytes
from posttrain.parallel import exchange
from posttrain.rl._config import RLConfig
from posttrain.rl._rollout import Rollouts, draw_groups
from posttrain.rl._sampler_weights import SamplerSide


class Stopped(Exception):
    """The producer was closed while it waited for weights."""


class RolloutProducer:
    """Decoupled rollouts: a thread samples and scores batches on the sampler's devices with the
    weights it was sent, at most `rollout.max_staleness` steps ahead of the trainer.

    Batch i (for RL step i) needs weights of version >= i - 1 - max_staleness (version v: the
    weights after v RL steps); with 0 it waits for the step before, which is on-policy. It
    samples with the newest version sent, which depends on how far the trainer got (timing);
    with `rollout.newest_weights=False` with exactly i - 1 - max_staleness, so a run is
    reproducible (and its sampler holds up to max_staleness + 1 versions of the weights).
    """

    def __init__(self, c: RLConfig, prompts, rollouts: Rollouts, side: SamplerSide, start: int):
        self.c, self.prompts, self.rollouts, self.side = c, prompts, rollouts, side
        self.sync_bytes = 0  # bytes sent to the sampler per published version
        self.ready: queue.Queue = queue.Queue()
        self.cond = threading.Condition()
        # The versions of the weights sent that a batch may still sample with (`_weights`).
        self.sent: dict[int, object] = {}
        self.version, self.stopped = -1, False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(start + 1,), daemon=True)
        self.started = False

    def publish(self, params, version: int) -> None:
        """Sends what the sampler needs of the trained params (after `version` RL steps) to
        its devices, resharding them onto its mesh."""
        sent = self.side.published(params)
        self.sync_bytes = param_bytes(sent)
        weights = jax.device_put(sent, self.side.shardings)
        with self.cond:
            self.sent[version], self.version = weights, version
            self.cond.notify_all()

    def _weights(self, bound: int, label: str, fixed: int | None = None):
        """`(weights, version)` to sample with, of version >= `bound`: the newest sent
        (`rollout.newest_weights`), else exactly `fixed` (default `bound`; at the start of a
        run the first version sent), waiting for it; raises `Stopped` once the producer is
        closed. Versions older than the one returned are dropped (later calls never go back).

        On several processes the processes agree (through the host, `label` naming the
        exchange): the version is the oldest of their newest, so every process samples with
        the same weights, and once one is closed all stop here, before the next exchange of
        sampled groups, which a stopped process would never join."""
        newest, fixed = self.c.rollout.newest_weights, bound if fixed is None else fixed
        with self.cond:
            self.cond.wait_for(lambda: self.stopped or self.version >= (bound if newest else fixed))
            stopped = self.stopped
            # (not older than the first version sent: a run's start, or where it resumed)
            version = self.version if newest else max(fixed, min(self.sent, default=fixed))
        if jax.process_count() > 1:
            mine = {"version": np.int64(version), "stopped": np.bool_(stopped)}
            theirs = exchange(self.rollouts.channel, f"{label}: weights", mine)
            stopped = any(bool(t["stopped"]) for t in theirs)
            version = min(int(t["version"]) for t in theirs)
        if stopped:
            raise Stopped
        with self.cond:
            for old in [v for v in self.sent if v < version]:
                del self.sent[old]
            return self.sent[version], version

    def get(self, step: int):
        """The rollouts for `step`: (prompts, completions, rewards, counts, prompt state)."""
        item = self.ready.get()
        if item is None:
            raise RuntimeError("the rollout thread failed") from self.error
        i, version, kept, completions, rewards, counts, state = item
        staleness = step - 1 - version
        if i != step or staleness > self.c.rollout.max_staleness:
            raise RuntimeError(f"rollout {i} (weights v{version}) for step {step}: out of bounds")
        counts = {
            **counts,
            "rollout_version": float(version),
            "staleness": float(staleness),
            "sync_bytes": float(self.sync_bytes),
        }
        return kept, completions, rewards, counts, state

    def _run(self, first: int) -> None:
        prepared, prepared_version = None, None
        try:
            for i in itertools.count(first):
                weights, version = self._weights(i - 1 - self.c.rollout.max_staleness, f"batch {i}")
                if version != prepared_version:
                    prepared, prepared_version = self.side.prepare(weights), version
                kept, completions, rewards, counts = draw_groups(
                    self.c, self.prompts, self.rollouts, prepared, i
                )
                state = self.prompts.get_state()
                self.ready.put((i, version, kept, completions, rewards, counts, state))
        except Stopped:
            return
        except BaseException as e:  # reported to the trainer by get()
            self.error = e
            self.ready.put(None)

    def start(self, params, version: int) -> None:
        self.publish(params, version)
        if not self.started:
            self.started = True
            self.thread.start()

    def close(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        if self.started:
            self.thread.join(timeout=300)
