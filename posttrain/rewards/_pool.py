"""Batched reward evaluation in worker processes, with a per-call timeout that kills hung workers.

`RewardPool` keeps `workers` processes, each holding a copy of the registry and fed one
(record, completion) at a time over its own pipe; the parent waits on all pipes with the
earliest deadline as timeout. A verifier still running at its deadline has its worker's whole
process group SIGKILLed (so children it spawned go too) and a fresh worker started in its place;
a worker that dies (segfault, `os.abort()`, OOM kill) is likewise replaced. Either way that
completion scores 0 with status "timeout" or "crash", is counted, and the batch carries on:
one hanging verifier never stalls a step. `concurrent.futures.ProcessPoolExecutor` cannot do
this: it can neither cancel a running task nor survive a dead worker.

Workers are started with "spawn" by default, never "fork": the trainer's process runs JAX
threads, and forking a multithreaded process can deadlock the child.

Reward-model and judge terms ("rm:<path>", `ModelReward`; "judge:<path>", `JudgeReward`) never
run in the workers, each of which would load the model onto the accelerator: the pool scores
them in its own process, one batched call per reference, and adds them to the workers' sums.
Their errors are the run's and propagate.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import resource
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from posttrain.rewards._registry import (
    RewardRegistry,
    RewardTerm,
    check_output,
    record_domain,
    resolve_fn,
)


@dataclass(frozen=True)
class RewardResult:
    """The reward of one completion."""

    score: float  # the domain's weighted sum; 0 unless status is "ok"
    info: dict  # {term name: term info} if ok, else {"error": why}
    domain: str
    status: str  # "ok", "timeout" (killed at its deadline) or "crash" (raised or died)
    # Wall time from dispatch to result, plus the batch's reward-model time where "rm:" terms
    # score the domain.
    seconds: float


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, ctx, registry: RewardRegistry):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_worker_main, args=(child, registry), daemon=True, name="reward-worker"
        )
        self.proc.start()
        child.close()  # so the parent reads EOF once the worker dies
        self.started = time.monotonic()
        self.ready = False
        self.task: tuple[int, float, float] | None = None  # (index, dispatch time, deadline)

    def kill(self) -> int | None:
        """SIGKILLs the worker's process group; returns its exit code."""
        if self.proc.exitcode is None:
            # The worker leads its own group (see `_worker_main`); before it gets there, the
            # group does not exist yet and killing the process alone is enough.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()
        return self.proc.exitcode


class RewardPool:
    """Scores batches of completions in worker processes, each call under a deadline.

    Example:
      with RewardPool(default_registry(), workers=8, timeout_s=10) as pool:
          results = pool.score(records, completions)  # in input order
          rewards = [r.score for r in results]
          log(pool.metrics(reset=True))

    Not thread-safe: call `score` from one thread at a time.
    """

    def __init__(
        self,
        registry: RewardRegistry,
        *,
        workers: int = 2,
        timeout_s: float = 10.0,
        domain_timeout_s: Mapping[str, float] | None = None,
        start_method: str = "spawn",
        startup_timeout_s: float = 120.0,
    ):
        """Starts the workers (without waiting for them: the first `score` does).

        Args:
          registry: the reward functions; copied into each worker.
          workers: the number of worker processes.
          timeout_s: the deadline of one completion's verification (all its domain's terms).
          domain_timeout_s: per-domain deadlines overriding `timeout_s` (e.g. {"code": 60}).
          start_method: "spawn" or "forkserver" ("fork" is unsafe once JAX runs threads).
          startup_timeout_s: how long a worker may take to import its reward functions.
        """
        if workers < 1:
            raise ValueError(f"RewardPool needs at least one worker, got workers={workers}")
        timeouts = {"timeout_s": timeout_s, **(domain_timeout_s or {})}
        if bad := {k: v for k, v in timeouts.items() if not v > 0}:
            raise ValueError(f"reward timeouts must be positive seconds, got {bad}")
        if start_method == "fork":
            raise ValueError("start_method='fork' can deadlock under JAX; use 'spawn'")
        self.registry = registry
        self.timeout_s = float(timeout_s)
        self.domain_timeout_s = dict(domain_timeout_s or {})
        self.startup_timeout_s = startup_timeout_s
        self._ctx = multiprocessing.get_context(start_method)
        self._workers = [_Worker(self._ctx, registry) for _ in range(workers)]
        self._totals: dict[str, list[float]] = {}
        self._sent: dict[int, int] = {}
        # Kills the workers when the pool is garbage collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)

    def score(
        self,
        records: Sequence[Mapping],
        completions: Sequence[str],
        domains: Sequence[str] | None = None,
    ) -> list[RewardResult]:
        """Scores each completion against its record, in parallel, each under its deadline.

        Args:
          records: prompt records with their verifier fields.
          completions: one generated text per record.
          domains: one domain per record; defaults to each record's "domain" field.

        Returns:
          One `RewardResult` per completion, in input order. Timeouts and crashes score 0.

        Raises:
          ValueError: mismatched lengths, an unknown or missing domain, or a record that does
            not pickle (all before anything runs).
          RuntimeError: a worker failed to start (its reward functions do not import).
          Exception: whatever a reward model term raises (scored here, before the workers).
        """
        if len(records) != len(completions):
            raise ValueError(f"{len(records)} records but {len(completions)} completions")
        domains = [record_domain(r) for r in records] if domains is None else list(domains)
        if len(domains) != len(records):
            raise ValueError(f"{len(records)} records but {len(domains)} domains")
        self.registry.check(domains, resolve=False)
        terms = {d: self.registry.terms(d) for d in set(domains)}
        payloads: list[bytes | None] = [None] * len(records)
        for i, (d, r, c) in enumerate(zip(domains, records, completions, strict=True)):
            if all(t.is_model for t in terms[d]):
                continue  # nothing for a worker to do
            try:
                payloads[i] = pickle.dumps((d, r, c), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:
                raise ValueError(f"record {i} cannot be sent to a reward worker: {e}") from e
        # Before the workers: a reward model error fails the call with nothing in flight.
        start = time.monotonic()
        model_outputs = _score_model_terms(terms, records, completions, domains)
        model_seconds = time.monotonic() - start
        results: list[RewardResult | None] = [None] * len(records)
        pending = deque(i for i, p in enumerate(payloads) if p is not None)
        self._sent: dict[int, int] = {}  # record -> when it went to a worker (ns, for spans)
        try:
            while pending or any(w.task for w in self._workers):
                self._dispatch(pending, payloads, domains)
                self._wait()
                self._collect(results, domains)
        except BaseException:
            # A worker still busy would answer into the next call: replace it.
            for i, w in enumerate(self._workers):
                if w.task:
                    self._replace(i)
            raise
        for i, d in enumerate(domains):
            if model_outputs[i]:
                result = results[i] or RewardResult(0.0, {}, d, "ok", 0.0)  # only model terms
                results[i] = _add_model_terms(result, terms[d], model_outputs[i], model_seconds)
        _tally(self._totals, results)
        # (imported here: a worker process imports this module, and needs no jax)
        from posttrain.parallel import tracing

        for i, sent in self._sent.items() if tracing.enabled() else ():
            r = results[i]
            tracing.record("reward.call", sent, sent + int(r.seconds * 1e9), domain=r.domain,
                           status=r.status, score=r.score)  # fmt: skip
        return results

    def metrics(self, *, reset: bool = False) -> dict[str, float]:
        """Per-domain totals since the last reset, as `summarize` lays them out."""
        out = _format(self._totals)
        if reset:
            self._totals = {}
        return out

    def close(self) -> None:
        """Stops the workers (killing any still busy)."""
        idle = [w for w in self._workers if w.ready and not w.task]
        for w in idle:
            with contextlib.suppress(OSError):
                w.conn.send(None)
        for w in idle:
            w.proc.join(1)
        self._finalizer()  # kills the rest: busy or still starting

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _timeout(self, domain: str) -> float:
        return self.domain_timeout_s.get(domain, self.timeout_s)

    def _dispatch(self, pending: deque, payloads: list[bytes], domains: list[str]) -> None:
        for k, w in enumerate(self._workers):
            if not (pending and w.ready and w.task is None):
                continue
            i = pending.popleft()
            try:
                w.conn.send_bytes(payloads[i])
            except OSError:  # died while idle: retry the record on a fresh worker
                pending.appendleft(i)
                self._replace(k)
                continue
            now = time.monotonic()
            w.task = (i, now, now + self._timeout(domains[i]))
            self._sent[i] = time.time_ns()

    def _wait(self) -> None:
        deadlines = [w.task[2] for w in self._workers if w.task] + [
            w.started + self.startup_timeout_s for w in self._workers if not w.ready
        ]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        multiprocessing.connection.wait([w.conn for w in self._workers], timeout)

    def _collect(self, results: list, domains: list[str]) -> None:
        for k, w in enumerate(self._workers):
            now = time.monotonic()
            if w.conn.poll():
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):
                    code = self._replace(k)
                    if not w.ready:
                        raise RuntimeError(
                            f"a reward worker died while starting ({_exit_reason(code)}); its "
                            "traceback is on stderr. A registered reward function must import "
                            "and unpickle in a fresh process."
                        ) from None
                    if w.task:
                        i, start, _ = w.task
                        error = f"reward worker died ({_exit_reason(code)})"
                        results[i] = RewardResult(
                            0.0, {"error": error}, domains[i], "crash", now - start
                        )
                    continue
                if not w.ready:
                    if msg[0] != "ready":
                        self._replace(k)
                        raise RuntimeError(f"a reward worker failed to start:\n{msg[1]}")
                    w.ready = True
                    continue
                status, score, info = msg
                i, start, _ = w.task
                results[i] = RewardResult(score, info, domains[i], status, now - start)
                w.task = None
            elif w.task and now >= w.task[2]:
                i, start, _ = w.task
                self._replace(k)
                error = f"no result within {self._timeout(domains[i])}s; worker killed"
                results[i] = RewardResult(0.0, {"error": error}, domains[i], "timeout", now - start)
            elif not w.ready and now >= w.started + self.startup_timeout_s:
                self._replace(k)
                raise RuntimeError(
                    f"a reward worker did not start within {self.startup_timeout_s}s; raise "
                    "startup_timeout_s or check that the reward functions import quickly"
                )

    def _replace(self, k: int) -> int | None:
        """Kills worker k and starts a fresh one in its place; returns the old exit code."""
        code = self._workers[k].kill()
        self._workers[k] = _Worker(self._ctx, self.registry)
        return code


def _score_model_terms(
    terms: Mapping[str, tuple[RewardTerm, ...]],
    records: Sequence[Mapping],
    completions: Sequence[str],
    domains: Sequence[str],
) -> list[dict[str, tuple[float, dict]]]:
    """Per record, {term name: checked (score, info)} of its "rm:" terms; one call per reference."""
    indices: dict[str, dict[int, None]] = {}  # ordered sets of record indices per reference
    for i, d in enumerate(domains):
        for t in terms[d]:
            if t.is_model:
                indices.setdefault(t.fn, {})[i] = None
    out = [{} for _ in records]
    for ref, idx in indices.items():
        scored = resolve_fn(ref).score_batch(
            [records[i] for i in idx], [completions[i] for i in idx], [domains[i] for i in idx]
        )
        for i, score_info in zip(idx, scored, strict=True):
            for t in terms[domains[i]]:
                if t.fn == ref:
                    out[i][t.name] = check_output(t, score_info)
    return out


def _add_model_terms(
    result: RewardResult,
    terms: tuple[RewardTerm, ...],
    outputs: Mapping[str, tuple[float, dict]],
    seconds: float,
) -> RewardResult:
    """A result with its domain's "rm:" terms added, as `RewardRegistry.score` combines terms."""
    if result.status != "ok":  # a worker term timed out or crashed: the record scores 0
        return replace(result, seconds=result.seconds + seconds)
    total, info = result.score, {}
    for t in terms:  # info in term order, as `RewardRegistry.score` builds it
        if t.is_model:
            score, info[t.name] = outputs[t.name]
            total += t.weight * score
        else:
            info[t.name] = result.info[t.name]
    return replace(result, score=total, info=info, seconds=result.seconds + seconds)


def summarize(results: Sequence[RewardResult]) -> dict[str, float]:
    """Per-domain metrics of a batch of results.

    Returns:
      {"rewards/<domain>/score": mean score (timeouts and crashes count as 0),
       ".../count", ".../timeouts", ".../crashes": counts, ".../seconds": mean latency}, and
      ".../judge_parse_failures" for domains with "judge:" terms: answers without a grade.
    """
    totals: dict[str, list[float]] = {}
    _tally(totals, results)
    return _format(totals)


def _tally(totals: dict[str, list[float]], results: Sequence[RewardResult]) -> None:
    """Adds results to per-domain [count, score sum, timeouts, crashes, seconds sum, judge parse
    failures (None until a result carries a judge term's info)]."""
    for r in results:
        t = totals.setdefault(r.domain, [0, 0.0, 0, 0, 0.0, None])
        t[0] += 1
        t[1] += r.score
        t[2] += r.status == "timeout"
        t[3] += r.status == "crash"
        t[4] += r.seconds
        judged = [i for i in r.info.values() if isinstance(i, dict) and "judge_parse_failure" in i]
        if judged:
            t[5] = (t[5] or 0) + sum(i["judge_parse_failure"] for i in judged)


def _format(totals: dict[str, list[float]]) -> dict[str, float]:
    out = {}
    for d, (n, score, timeouts, crashes, seconds, parse_failures) in sorted(totals.items()):
        out[f"rewards/{d}/score"] = score / n
        out[f"rewards/{d}/count"] = n
        out[f"rewards/{d}/timeouts"] = timeouts
        out[f"rewards/{d}/crashes"] = crashes
        out[f"rewards/{d}/seconds"] = seconds / n
        if parse_failures is not None:
            out[f"rewards/{d}/judge_parse_failures"] = parse_failures
    return out


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _kill_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.kill()


def _worker_main(conn, registry: RewardRegistry) -> None:
    """A worker's loop: receive (domain, record, completion), send (status, score, info)."""
    # Lead a process group, so a timeout kill also takes whatever the verifier spawned.
    with contextlib.suppress(OSError):
        os.setpgrp()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crashing verifier dumps no core
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    # Import every reward function now, not under the first record's deadline; one that fails
    # to import is reported per record, as a crash, when its domain is scored.
    for d in registry.domains():
        for t in registry.terms(d):
            if t.is_model:  # the parent scores these
                continue
            with contextlib.suppress(Exception):
                resolve_fn(t.fn)
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        domain, record, completion = msg
        try:
            score, info = registry.score(record, completion, domain, model_terms=False)
            reply = ("ok", score, info)
        except Exception as e:
            reply = ("crash", 0.0, {"error": f"{type(e).__name__}: {e}"[:2000]})
        try:
            conn.send(reply)
        except Exception as e:  # the info did not pickle; the stream is intact (pickled first)
            conn.send(("crash", 0.0, {"error": f"reward info does not pickle: {e}"[:2000]}))


def _exit_with_parent(parent_pid: int) -> None:
    """Ends an orphaned worker (its parent was killed without closing the pool)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)
