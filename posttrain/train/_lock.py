"""One run per workdir: a lease in `<workdir>/lock.json`.

The lock file names its holder (host, pid, start time, a random token) and the time of its last
heartbeat, which a daemon thread rewrites every `lease_s / 3` seconds. A lease whose heartbeat is
older than `lease_s` has expired (its run crashed, was SIGKILLed, or its host is gone) and the
next run takes it over; so does a run on the same host (and pid namespace) as a holder whose pid
no longer exists, at once. A second run on a live lease raises `WorkdirBusyError` naming the
holder, before it loads, compiles or writes anything else.

How the file is claimed:
  - local: a new lock is created with `O_CREAT | O_EXCL`, so exactly one run creates it. An
    expired or dead one is replaced by write-then-rename; each taker then waits `settle_s` and
    re-reads the file, and only the one whose token is there goes on. Two runs that take over
    the same expired lease both win only if one renames more than `settle_s` after the other
    read the stale lease (a stalled process).
  - gs:// (through gcsfs): a new lock is uploaded with `ifGenerationMatch=0`, which GCS refuses
    when the object exists; a takeover is a plain overwrite. Both are confirmed by re-reading
    after `settle_s`, as above, which is also all that protects a create on a store or emulator
    that ignores the precondition: two runs that both find no lock and upload within
    `settle_s` of each other's confirming read could both go on. Heartbeats and release are
    read-check-write, with the same small window.

Ages compare the holder's clock with the reader's: hosts' clocks must agree to well within
`lease_s`. A holder whose heartbeat finds someone else's token in the file (it stalled past its
lease and was taken over) logs an error and stops refreshing; it does not stop its run.

Multi-process runs: only process 0 takes the lock (`run_lock`). When it is refused it exits, and
the other processes, waiting for it in their first collective, are stopped by JAX's heartbeat
and their step watchdog.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import secrets
import socket
import threading
import time

import jax

from posttrain import paths
from posttrain.errors import WorkdirBusyError

log = logging.getLogger(__name__)

LOCK_FILE = "lock.json"
DEFAULT_LEASE_S = 60.0
_ATTEMPTS = 4  # reads of a missing, unreadable or just-taken lock before giving up


class WorkdirLock:
    """The lease on one workdir; a context manager (acquire on enter, release on exit).

    Args:
      workdir: the run directory (local or gs://); it is created if missing.
      lease_s: a heartbeat older than this means the holder is gone. The holder's own value
        (written in the file) is the one readers use.
      settle_s: how long a new holder waits before re-reading the file to confirm it won.
    """

    def __init__(self, workdir: str, *, lease_s: float = DEFAULT_LEASE_S, settle_s: float = 1.0):
        self.workdir = workdir
        self.path = paths.join(workdir, LOCK_FILE)
        self.lease_s = lease_s
        self.settle_s = settle_s
        self.lost = False  # set when a heartbeat finds the lease taken by another run
        self._remote = paths.is_remote(workdir)
        self._fs = None
        if self._remote:
            import fsspec

            # The filesystem directly: `cat_file` is one GET (no cached listing behind it) and
            # `pipe_file(mode="create")` sends GCS's create-only precondition.
            self._fs = fsspec.core.url_to_fs(self.path)[0]
        self._token = secrets.token_hex(8)
        self._started = _now_iso()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._thread is not None

    def acquire(self) -> None:
        """Takes the lease, or raises `WorkdirBusyError` if a live run holds it."""
        if self.held:
            return
        if not self._remote:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        holder = None
        for _ in range(_ATTEMPTS):
            holder = self._read()
            if holder is None:
                try:
                    self._create()
                except FileExistsError:
                    continue  # another run created it just now: read whose it is
                if not self._remote:  # O_EXCL: no one else can have created it too
                    break
            elif holder == "unreadable":
                time.sleep(self.settle_s)  # a local create is between open and write
                if self._read() != "unreadable":
                    continue
                log.warning("%s is unreadable; taking it over", self.path)
                self._write(self._record())
            elif reason := self._gone(holder):
                log.warning("taking over %s: %s", self.path, reason)
                self._write(self._record())
            else:
                raise self._busy(holder)
            time.sleep(self.settle_s)
            if self._owned():
                break
        else:
            raise self._busy(holder if isinstance(holder, dict) else {})
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="workdir-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stops the heartbeat and deletes the lock file if it is still this run's."""
        if not self.held:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        try:
            if self._owned():
                self._delete()
        except Exception:  # (never hide the exception a run is leaving with)
            log.warning("could not delete %s", self.path, exc_info=True)

    def __enter__(self) -> WorkdirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _record(self) -> dict:
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_namespace": _pid_namespace(),
            "started": self._started,
            "token": self._token,
            "heartbeat": time.time(),
            "heartbeat_iso": _now_iso(),
            "lease_s": self.lease_s,
        }

    def _gone(self, holder: dict) -> str | None:
        """Why `holder` no longer holds the lease, or None if it is live."""
        age = time.time() - holder.get("heartbeat", 0.0)
        lease = holder.get("lease_s", self.lease_s)
        if age > lease:
            return f"its last heartbeat was {age:.0f} s ago (lease {lease:.0f} s)"
        same_host = holder.get("host") == socket.gethostname()
        if same_host and holder.get("pid_namespace") == _pid_namespace():
            if not paths.pid_alive(holder.get("pid", 0)):
                return f"its process {holder.get('pid')} on this host is gone"
        return None

    def _busy(self, holder: dict) -> WorkdirBusyError:
        age = time.time() - holder.get("heartbeat", time.time())
        lease = holder.get("lease_s", self.lease_s)
        return WorkdirBusyError(
            f"workdir {self.workdir} is in use by another run: host {holder.get('host', '?')}, "
            f"pid {holder.get('pid', '?')}, started {holder.get('started', '?')}, last "
            f"heartbeat {max(age, 0.0):.0f} s ago. Wait for it to finish, stop it, or train in "
            f"another workdir. If that run is surely dead, its lease expires {lease:.0f} s after "
            f"its last heartbeat and the next run takes over (or delete {self.path})."
        )

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                if not self._owned():
                    self.lost = True
                    log.error(
                        "the lease on %s was taken by another run (this one missed its "
                        "heartbeats for %.0f s); two runs may now write this workdir",
                        self.workdir,
                        self.lease_s,
                    )
                    return
                self._write(self._record())
            except Exception:  # a store's hiccup: the next beat tries again
                log.warning("could not refresh %s", self.path, exc_info=True)

    def _owned(self) -> bool:
        holder = self._read()
        return isinstance(holder, dict) and holder.get("token") == self._token

    def _read(self) -> dict | str | None:
        """The holder's record; None when there is no lock, "unreadable" when it is not JSON."""
        try:
            if self._remote:
                data = self._fs.cat_file(self.path)
            else:
                with open(self.path, "rb") as f:
                    data = f.read()
        except FileNotFoundError:
            return None
        try:
            record = json.loads(data)
        except ValueError:
            return "unreadable"
        return record if isinstance(record, dict) else "unreadable"

    def _create(self) -> None:
        """Writes a new lock file; FileExistsError if there is one (where the store can tell)."""
        data = json.dumps(self._record()).encode()
        if self._remote:
            self._fs.pipe_file(self.path, data, mode="create")
            return
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def _write(self, record: dict) -> None:
        """Replaces the lock file whole (local: write-then-rename; an object upload is atomic)."""
        data = json.dumps(record).encode()
        if self._remote:
            self._fs.pipe_file(self.path, data)
        else:
            paths.write_bytes(self.path, data)

    def _delete(self) -> None:
        if self._remote:
            self._fs.rm_file(self.path)
        else:
            os.unlink(self.path)


_HELD: dict[str, WorkdirLock] = {}  # workdir -> this process's lock on it, during a run


def claim(workdir: str) -> None:
    """Takes `workdir`'s lock for this process's run (kept until `run_lock` ends); nothing if
    this process holds it already or is not process 0."""
    key = paths.join(workdir)
    if jax.process_index() != 0 or key in _HELD:
        return
    lock = WorkdirLock(workdir)
    lock.acquire()
    _HELD[key] = lock


@contextlib.contextmanager
def run_lock(workdir: str):
    """Holds `workdir`'s lock (taking it if an earlier `claim` did not) until the block ends."""
    claim(workdir)
    try:
        yield
    finally:
        if lock := _HELD.pop(paths.join(workdir), None):
            lock.release()


def _pid_namespace() -> str:
    """This process's pid namespace: pids mean the same only within one (containers sharing a
    hostname have separate ones)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
