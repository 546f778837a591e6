"""What processes tell each other on the host, and the check that they still agree.

Small per-process values (a step's sampled token ids, log-probs and rewards: a few KB) travel
through JAX's coordination service (`exchange`), not through a device collective. A device
collective is a program in each process's queue of device work; two threads that each issue
programs spanning processes (a decoupled sampler's exchange and the trainer's step) can queue
them in a different order on each process, and XLA:CPU runs a process's multi-device programs
one at a time in the order they were queued, so such a pair deadlocks. A host exchange queues
nothing on any device.

Every exchange also carries a label (what the process thinks it is exchanging: "step 3
attempt 0, 8 prompts") and the count of programs spanning processes that the calling thread
has issued so far (`crossing`); processes that disagree on either raise `ProcessesDiverged`
naming both sides, instead of waiting forever in the first collective they no longer share.
`agree(label)` is that check alone; the train loop runs it before every step when
`POSTTRAIN_CHECK_PROCESSES=1` (the tests set it).
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import threading

import jax
import numpy as np

CHECK_ENV = "POSTTRAIN_CHECK_PROCESSES"
_PREFIX = "posttrain/exchange"
_sequence: collections.Counter = collections.Counter()  # exchanges made per channel
_sequence_lock = threading.Lock()
_ledgers = threading.local()


class ProcessesDiverged(RuntimeError):
    """Processes of one run disagree on what they are doing (a bug, not a user error)."""


def checks_enabled() -> bool:
    """Whether the per-step agreement check is on (`POSTTRAIN_CHECK_PROCESSES=1`)."""
    return os.environ.get(CHECK_ENV, "") not in ("", "0")


def _ledger() -> dict:
    if not hasattr(_ledgers, "state"):
        _ledgers.state = {"count": 0, "digest": "", "recent": collections.deque(maxlen=6)}
    return _ledgers.state


def crossing(label: str) -> None:
    """Records that this thread issues a device program spanning processes (`label`: what it
    is, with the shapes that must match), for the next `exchange` or `agree` to compare."""
    if jax.process_count() == 1:
        return
    ledger = _ledger()
    ledger["count"] += 1
    ledger["digest"] = hashlib.sha1((ledger["digest"] + label).encode()).hexdigest()[:16]
    ledger["recent"].append(label)


def exchange(
    channel: str, label: str, arrays: dict[str, np.ndarray], timeout_s: float = 3600.0
) -> list[dict[str, np.ndarray]]:
    """Every process's `arrays`, in process order, on every process (no device work).

    Each process calls it for the same `channel` in the same order; the n-th call on a
    channel meets the other processes' n-th. Their labels and crossing ledgers must match.

    Raises:
      ProcessesDiverged: a label or ledger differs between processes, or another process did
        not arrive within `timeout_s` (it died, hung, or went down another path).
    """
    if jax.process_count() == 1:
        return [arrays]
    from jax._src import distributed

    client = distributed.global_state.client
    with _sequence_lock:
        seq = _sequence[channel]
        _sequence[channel] += 1
    me, n = jax.process_index(), jax.process_count()
    ledger = _ledger()
    header = {"label": label, "count": ledger["count"], "digest": ledger["digest"],
              "recent": list(ledger["recent"])}  # fmt: skip
    client.key_value_set_bytes(f"{_PREFIX}/{channel}/{seq}/{me}", _pack(header, arrays))
    out, headers = [], []
    for p in range(n):
        if p == me:
            headers.append(header)
            out.append(arrays)
            continue
        key = f"{_PREFIX}/{channel}/{seq}/{p}"
        try:
            blob = client.blocking_key_value_get_bytes(key, int(timeout_s * 1000))
        except Exception as e:  # (a deadline or a lost coordination service)
            raise ProcessesDiverged(
                f"process {me} waited {timeout_s:.0f} s at exchange {seq} of {channel!r} "
                f"({label}) for process {p}, which never arrived: it died, hung, or took "
                f"another path ({type(e).__name__}: {e})"
            ) from None
        theirs, values = _unpack(blob)
        headers.append(theirs)
        out.append(values)
    _compare(channel, seq, headers)
    if seq > 0:  # every process has read it: each wrote this exchange after finishing that one
        client.key_value_delete(f"{_PREFIX}/{channel}/{seq - 1}/{me}")
    return out


def agree(channel: str, label: str) -> None:
    """Checks that every process is at `label` with the same crossings issued so far."""
    exchange(channel, label, {})


def _compare(channel: str, seq: int, headers: list[dict]) -> None:
    first = headers[0]
    for p, h in enumerate(headers[1:], start=1):
        if (h["label"], h["count"], h["digest"]) == (first["label"], first["count"],
                                                      first["digest"]):  # fmt: skip
            continue
        sides = "\n".join(
            f"  process {i}: at {x['label']!r} after {x['count']} programs spanning processes "
            f"(the last: {x['recent']})"
            for i, x in ((0, first), (p, h))
        )
        raise ProcessesDiverged(
            f"the processes diverged at exchange {seq} of {channel!r}: they no longer issue "
            f"the same device programs in the same order, and the next collective would hang:"
            f"\n{sides}"
        )


def _pack(header: dict, arrays: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, __header__=np.frombuffer(json.dumps(header).encode(), np.uint8), **arrays)
    return buffer.getvalue()


def _unpack(blob: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    with np.load(io.BytesIO(blob)) as data:
        arrays = {k: data[k] for k in data.files}
    header = json.loads(arrays.pop("__header__").tobytes().decode())
    return header, arrays
