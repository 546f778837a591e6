"""An elastic pool of worker threads for environment steps (tool calls, sandboxes, tests).

Episodes wait on their tools while the engine decodes the others, so the work queue swells
and drains with the rollout: the pool adds a thread when a task arrives and no thread is
free (up to `max_workers`), and a thread that finds no work for `idle_s` leaves (down to
`min_workers`). Threads suit this work: a sandboxed tool call waits on its own process.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class ElasticPool:
    """Runs submitted calls on `min_workers`..`max_workers` threads, grown with the queue.

    Attributes:
      size: threads alive now; peak: the most alive at once; spawned: threads started;
      name: the name of this pool's threads ("posttrain-env-<n>", one n per pool).
    """

    _count = itertools.count()

    def __init__(self, min_workers: int = 1, max_workers: int = 8, idle_s: float = 2.0):
        if not 0 <= min_workers <= max_workers or max_workers < 1:
            raise ValueError(
                f"pool workers: need 0 <= min_workers <= max_workers and max_workers >= 1, got "
                f"{min_workers}..{max_workers}"
            )
        self.min_workers, self.max_workers, self.idle_s = min_workers, max_workers, idle_s
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.size = self.peak = self.spawned = 0
        self._pending = self._busy = 0
        self._closed = False
        self.name = f"posttrain-env-{next(self._count)}"
        for _ in range(min_workers):
            self._spawn()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the pool is closed")
            self._pending += 1
            self._tasks.put((future, fn, args))
            # More queued calls than free threads: one more thread, if allowed.
            if self._pending > self.size - self._busy and self.size < self.max_workers:
                self._spawn()
        return future

    def _spawn(self) -> None:  # (with the lock held, or from __init__)
        self.size += 1
        self.spawned += 1
        self.peak = max(self.peak, self.size)
        threading.Thread(target=self._work, daemon=True, name=self.name).start()

    def _work(self) -> None:
        while True:
            try:
                item = self._tasks.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:  # (a call submitted meanwhile keeps this thread)
                    if self._pending == 0 and self.size > self.min_workers:
                        self.size -= 1
                        return
                continue
            if item is None:  # closing
                with self._lock:
                    self.size -= 1
                return
            future, fn, args = item
            with self._lock:
                self._pending -= 1
                self._busy += 1
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # reported to whoever waits on the future
                    future.set_exception(e)
            with self._lock:
                self._busy -= 1

    def close(self) -> None:
        """Lets queued calls finish, then ends every thread."""
        with self._lock:
            self._closed = True
            for _ in range(self.size):
                self._tasks.put(None)

    def __enter__(self) -> ElasticPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
