"""Partial rollouts with in-flight weight updates (decoupled mode, `rollout.partial`).

The decoupled sampler keeps up to twice a step's prompt groups in flight on its engine. A
step's batch is the first `data.batch_size` groups to finish, so a few long generations do
not hold up the batch; the others keep decoding into later batches, and when the trainer
publishes new weights they continue on them between two engine calls (with the KV cache they
have), instead of being thrown away. Each token records the version of the weights that
decoded it; the loss's off-policy correction (`loss.correction`) reweights or drops tokens
whose sampler differs from the trainer's old policy.

Admission control keeps every token within `rollout.max_staleness` of the step that trains
on it: batch `i` is only decoded with weights of version >= i - 1 - max_staleness; a group
whose oldest token would be too stale for the next batch is finished and taken into this
one (oldest groups first); and a group only starts on a version if the untaken groups as old
fit the batches that can still take them, so those that must be taken always fit. Nothing
that was sampled is discarded (a resumed run starts with nothing in flight: the prompts that
were are not drawn again).
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import jax
import numpy as np

from posttrain.models import Transformer
from posttrain.rl._domains import component_means
from posttrain.rl._rollout_producer import RolloutProducer
from posttrain.sampling import Request, request_completions


@dataclasses.dataclass
class _Group:
    prompt: dict
    request: Request
    first_version: int  # the weights' version when it was submitted (<= its first token's)
    completions: list | None = None
    rewards: np.ndarray | None = None


class _Stopped(Exception):
    """The producer was closed while it waited for weights."""


class PartialProducer(RolloutProducer):
    """`RolloutProducer` whose batches are made of the groups that finish first, with the
    rest continuing on newer weights (see the module docstring)."""

    def __init__(self, c, prompts, rollouts, side, start: int):
        super().__init__(c, prompts, rollouts, side, start)
        self.in_flight: list[_Group] = []
        self.finished: list[_Group] = []
        self.waiting: list[dict] = []  # prompts drawn, not yet submitted
        self.submitted = 0  # groups submitted so far (their sampling seeds)
        self.engine = None
        self._prepared_version = None

    def _run(self, first: int) -> None:
        try:
            for i in itertools.count(first):
                taken, counts = self._batch(i)
                kept = [g.prompt for g in taken]
                completions = [g.completions for g in taken]
                rewards = np.asarray([g.rewards for g in taken], np.float32)
                version = min(v for g in completions for c in g for v in c.versions or (i - 1,))
                state = self.prompts.get_state()
                self.ready.put((i, version, kept, completions, rewards, counts, state))
        except _Stopped:
            return
        except BaseException as e:  # reported to the trainer by get()
            self.error = e
            self.ready.put(None)

    def get(self, step: int):
        kept, completions, rewards, counts, state = super().get(step)
        versions = np.asarray([v for g in completions for c in g for v in c.versions])
        staleness = step - 1 - versions
        counts = {
            **counts,
            "token_staleness_mean": float(staleness.mean()) if versions.size else 0.0,
            "token_staleness_max": float(staleness.max(initial=0)),
            # groups whose tokens came from more than one version of the weights
            "groups_spanning_versions": float(
                sum(len({v for c in g for v in c.versions}) > 1 for g in completions)
            ),
        }
        return kept, completions, rewards, counts, state

    def _weights(self, bound: int) -> int:
        """Waits for weights of version >= bound; swaps the newest into the engine."""
        with self.cond:
            self.cond.wait_for(lambda: self.stopped or self.version >= bound)
            if self.stopped:
                raise _Stopped
            weights, version = self.weights, self.version
        if version != self._prepared_version:
            model = Transformer(self.side.prepare(weights), self.rollouts.model_config)
            self.engine = self.rollouts.engine_for(model)
            self.engine.set_eos(self.rollouts.tokenizer.eos_ids)
            self.engine.version, self._prepared_version = version, version
        return version

    def _submit(self, i: int, version: int) -> None:
        """Starts groups while fewer than two batches' worth are in flight or waiting to be
        taken, and while the untaken groups as old as this version fit the batches that may
        still take them: a group started on version v must be in a batch <= v + 1 +
        max_staleness, and batches i .. v + 1 + max_staleness hold that many batches' worth."""
        c, r = self.c, self.c.rollout
        groups = c.data.batch_size
        room = (version + 2 + r.max_staleness - i) * groups
        while len(self.in_flight) + len(self.finished) < 2 * groups and room > sum(
            g.first_version <= version for g in self.in_flight + self.finished
        ):
            if not self.waiting:
                self.waiting = list(next(self.prompts))
            prompt = self.waiting.pop(0)
            seed = np.random.SeedSequence([c.train.seed, self.submitted]).generate_state(1)[0]
            request = Request(
                prompt=list(prompt["prompt_ids"]),
                max_new_tokens=r.max_new_tokens,
                key=jax.random.key(int(seed)),
                n=r.num_generations,
                sampling=r.sampling,
            )
            self.engine.submit(request)
            self.in_flight.append(_Group(prompt, request, version))
            self.submitted += 1

    def _batch(self, i: int) -> tuple[list[_Group], dict]:
        """Batch i: decodes until a batch's worth of groups has finished and none that would
        be too stale for batch i + 1 is still running; takes the oldest."""
        groups, bound = self.c.data.batch_size, i - 1 - self.c.rollout.max_staleness
        timings = {"generate_s": 0.0, "reward_s": 0.0}
        while True:
            version = self._weights(bound)
            self._submit(i, version)
            # (a group started on version <= bound would be too stale for batch i + 1)
            expiring = any(g.first_version <= bound for g in self.in_flight)
            if len(self.finished) >= groups and not expiring:
                break
            if not self.in_flight:  # (cannot happen: an empty engine always has room)
                raise RuntimeError("partial rollouts: no group in flight and too few finished")
            start = time.perf_counter()
            done = {id(req) for req in self.engine.step()}
            generated = time.perf_counter()
            ended = [g for g in self.in_flight if id(g.request) in done]
            self.in_flight = [g for g in self.in_flight if id(g.request) not in done]
            for g in ended:
                g.completions = request_completions(self.rollouts.tokenizer, self.engine, g.request)
            if ended:
                rewards = self.rollouts.score(
                    [g.prompt for g in ended], [g.completions for g in ended], timings=timings
                )
                for g, r in zip(ended, rewards, strict=True):
                    g.rewards = r
            self.finished += ended
            timings["generate_s"] += generated - start
            timings["reward_s"] += time.perf_counter() - generated
        self.finished.sort(key=lambda g: g.first_version)  # (stable: first submitted first)
        taken, self.finished = self.finished[:groups], self.finished[groups:]
        if any(g.first_version <= bound for g in self.finished):
            raise RuntimeError("partial rollouts: more groups are due than a batch holds")
        counts = {
            "prompts_drawn": float(len(taken)),
            "groups_dropped": 0.0,
            "groups_in_flight": float(len(self.in_flight)),
            **component_means(timings),
        }
        return taken, counts
