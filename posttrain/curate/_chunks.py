"""Records of several sources in fixed-size chunks, each chunk handed to a function in a worker
process, the results coming back in input order (the data tools' parallel pass).

Workers read their chunk's records themselves (each gets the sources' file indexes once), so
only the small per-chunk results cross between processes. Workers start only when the input
pays for them: the first chunk runs in this process, timed, and a pool is started for the rest
only when their work split over the workers saves more than a pool takes to start
(`POOL_START_S`), so a few thousand quick records do not wait for one. Workers are
spawned, not forked: a forked child of a process where JAX runs threads can deadlock (as
in `rewards._pool`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tqdm import tqdm

from posttrain.data import RecordError, Records, decode

CHUNK = 2048  # records per task: big enough to vectorise, small enough to balance the workers
# What starting a pool of spawned workers costs before the first result: each imports
# posttrain.curate (JAX, grain, sympy): 2.3 s on an idle 2-core machine, up to ~10 s on a busy
# one (benchmarks/dedup_workers.py). The first chunk is run here and timed; the rest go to
# workers only when they would save more than this.
POOL_START_S = 5.0

_STATE: dict[str, Any] = {}  # the sources, function and its arguments, set once per worker


class BadRecord(ValueError):
    """A malformed record; the message starts with its location."""


def decoded(raw: Any, where: str) -> dict[str, Any]:
    """A raw record as a dict; a malformed one raises `BadRecord` naming its location."""
    try:
        return dict(decode(raw))
    except RecordError as e:
        raise BadRecord(f"{where}: {e}") from None


def default_workers() -> int:
    """One worker per CPU core this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _init(sources: Sequence[Records], fn: Callable, args: tuple) -> None:
    _STATE.update(sources=sources, fn=fn, args=args)


def _run(task: tuple[int, int, int]) -> Any:
    source, start, stop = task
    records = _STATE["sources"][source]
    batch = [decoded(*records[i]) for i in range(start, stop)]
    return _STATE["fn"](batch, *_STATE["args"])


def map_chunks(
    sources: Sequence[Records],
    fn: Callable,
    args: tuple = (),
    *,
    workers: int = 1,
    desc: str = "records",
    progress: bool = True,
    chunk: int | None = None,
) -> Iterator[tuple[tuple[int, int, int], Any]]:
    """`fn(records, *args)` over chunks of every source's records, in order.

    Args:
      sources: the record files, one `Records` per input.
      fn: a top-level (picklable) function of a list of record dicts and `args`.
      args: further arguments, sent to each worker once.
      workers: processes at most; 1 runs `fn` here, in this process, as does any number when
        the first chunk's time says the rest would not pay for starting them.
      desc: the progress bar's label.
      progress: show a tqdm bar (only on a terminal).
      chunk: records per call (default `CHUNK`).

    Yields:
      ((source index, first record, one past the last), fn's result) per chunk, in input order.
    """
    chunk = chunk or CHUNK
    tasks = [
        (s, start, min(start + chunk, len(records)))
        for s, records in enumerate(sources)
        for start in range(0, len(records), chunk)
    ]
    total = sum(len(r) for r in sources)
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(
            tqdm(total=total, desc=desc, unit="rec", disable=None if progress else True)
        )
        _init(sources, fn, args)  # (the first chunk, and every chunk without workers, run here)
        stack.callback(_STATE.clear)
        try:
            for task, result in zip(tasks, _results(tasks, workers, stack), strict=True):
                bar.update(task[2] - task[1])
                yield task, result
        except BadRecord as e:  # from a worker: raised again here, a user error (exit 2)
            raise BadRecord(str(e)) from None


def _results(tasks: list, workers: int, stack: contextlib.ExitStack) -> Iterator[Any]:
    """The tasks' results in order: the first computed here and timed, the rest by a pool of
    `workers` when that saves more than `POOL_START_S`, else here too."""
    if not tasks:
        return
    start = time.perf_counter()
    yield _run(tasks[0])
    seconds, rest = time.perf_counter() - start, tasks[1:]
    workers = max(1, min(workers, len(rest)))
    if workers > 1 and seconds * len(rest) * (1 - 1 / workers) > POOL_START_S:
        ctx = multiprocessing.get_context("spawn")
        init = (_STATE["sources"], _STATE["fn"], _STATE["args"])
        yield from stack.enter_context(ctx.Pool(workers, _init, init)).imap(_run, rest)
    else:
        yield from map(_run, rest)
