"""Host exchanges between processes (`posttrain.parallel.exchange`): values of different sizes
come back in process order with no device work, and processes that no longer agree (another
label, another count of programs spanning processes, one that never arrives) raise
ProcessesDiverged naming both sides instead of hanging."""

import json

import pytest

from posttrain.parallel import agree, crossing, exchange
from tests.launch import finish, launch_group

_RUNNER = """
import json
import numpy as np
from posttrain.parallel import initialize
initialize()
import jax
from posttrain.parallel import ProcessesDiverged, agree, crossing, exchange

me = jax.process_index()
report = {}
got = exchange("test", "rows", {"x": np.arange(me + 2, dtype=np.int32)})
report["gathered"] = [v["x"].tolist() for v in got]

def diverged(call):
    try:
        call()
    except ProcessesDiverged as e:
        return str(e)
    return None

# Another label: process 1 is one step ahead.
report["label"] = diverged(lambda: agree("test", f"step {3 + me}"))
# One process never arrives (process 1 goes on to the next exchange).
if me == 0:
    report["missing"] = diverged(lambda: exchange("late", "eval", {}, timeout_s=2))
# Another count of programs spanning processes: process 1 issued one more.
if me == 1:
    crossing("a train step only process 1 ran")
report["ledger"] = diverged(lambda: agree("test", "step 5"))
print("REPORT", json.dumps(report), flush=True)
"""


def _reports(outputs):
    return [json.loads(out.split("REPORT ", 1)[1].splitlines()[0]) for out in outputs]


def test_exchange_gathers_in_process_order_and_names_divergence():
    pair = launch_group(["-c", _RUNNER], processes=2, devices=1)
    reports = _reports([finish(p, timeout=300) for p in pair])
    for r in reports:
        assert r["gathered"] == [[0, 1], [0, 1, 2]]  # process 0's 2 values, process 1's 3
        assert "'step 3'" in r["label"] and "'step 4'" in r["label"], r["label"]
        assert "after 0 programs" in r["ledger"] and "after 1 programs" in r["ledger"]
        assert "a train step only process 1 ran" in r["ledger"]
    missing = reports[0]["missing"]
    assert "waited 2 s" in missing and "for process 1, which never arrived" in missing


def test_one_process_exchanges_with_itself():
    crossing("ignored in one process")
    assert exchange("solo", "anything", {"x": 1}) == [{"x": 1}]
    agree("solo", "step 1")  # nothing to compare


@pytest.mark.parametrize("value", [0, 1])
def test_checks_follow_the_environment(monkeypatch, value):
    from posttrain.parallel import CHECK_ENV, checks_enabled

    monkeypatch.setenv(CHECK_ENV, str(value))
    assert checks_enabled() is bool(value)
