"""Records of several sources in fixed-size chunks, each chunk handed to a function in a worker
process, the results coming back in input order (the data tools' parallel pass).

Workers read their chunk's records themselves (each gets the sources' file indexes once), so
only the small per-chunk results cross between processes. Workers are spawned, not forked: a
forked child of a process where JAX runs threads can deadlock (as in `rewards._pool`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tqdm import tqdm

from posttrain.data import RecordError, Records, decode

CHUNK = 2048  # records per task: big enough to vectorise, small enough to balance the workers

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
      workers: processes; 1 runs `fn` here, in this process.
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
        workers = max(1, min(workers, len(tasks)))
        if workers > 1:
            ctx = multiprocessing.get_context("spawn")
            pool = stack.enter_context(ctx.Pool(workers, _init, (sources, fn, args)))
            results = pool.imap(_run, tasks)
        else:
            _init(sources, fn, args)
            stack.callback(_STATE.clear)
            results = map(_run, tasks)
        try:
            for task, result in zip(tasks, results, strict=True):
                bar.update(task[2] - task[1])
                yield task, result
        except BadRecord as e:  # from a worker: raised again here, a user error (exit 2)
            raise BadRecord(str(e)) from None
