"""Reward pool: input order, deadlines that kill hung workers, crash recovery, metrics, speed."""

import os
import subprocess
import time

import pytest

from posttrain.rewards import RewardPool, RewardRegistry, summarize

TIMEOUT_S = 1.0


# Reward functions run in spawned workers, which import them from this module by name.
def echo(record, completion):
    time.sleep(record.get("sleep", 0.0))
    return float(record["x"]), {"completion": completion}


def sleep_forever(record, completion):
    while True:
        time.sleep(1)


def raises(record, completion):
    raise RuntimeError("verifier bug")


def aborts(record, completion):
    os.abort()


def spawns_and_hangs(record, completion):
    child = subprocess.Popen(["sleep", "1000"])
    with open(record["pid_file"], "w") as f:
        f.write(str(child.pid))
    sleep_forever(record, completion)


def returns_a_float(record, completion):
    return 0.5  # TRL's signature returns floats; ours wants (score, info dict)


def unpicklable_info(record, completion):
    return 1.0, {"lock": __import__("threading").Lock()}


def _fail_to_load():
    raise ImportError("verifier dependency missing in the worker")


class LoadsNowhere:
    """A reward that pickles in the parent but fails to unpickle in a worker."""

    def __call__(self, record, completion):
        return 1.0, {}

    def __reduce__(self):
        return _fail_to_load, ()


@pytest.fixture(scope="module")
def pool():
    registry = RewardRegistry()
    registry.register("echo", echo)
    registry.register("echo2", echo, weight=0.5)
    registry.register("echo2", "tests.rewards.test_pool:echo", weight=0.25, name="again")
    registry.register("math", "posttrain.rewards:math_reward")
    for fn in (sleep_forever, raises, aborts, spawns_and_hangs, unpicklable_info, returns_a_float):
        registry.register(fn.__name__, fn)
    with RewardPool(registry, workers=2, timeout_s=TIMEOUT_S, domain_timeout_s={"echo": 30}) as p:
        p.score([{"domain": "echo", "x": 0}] * 2, ["warm", "up"])  # wait for both workers
        p.metrics(reset=True)
        yield p


@pytest.fixture(autouse=True)
def fresh_metrics(request):
    if "pool" in request.fixturenames:
        request.getfixturevalue("pool").metrics(reset=True)


def _echo_batch(n):
    return [{"domain": "echo", "x": i} for i in range(n)], [f"c{i}" for i in range(n)]


def test_results_in_input_order_with_weights(pool):
    # Earlier records sleep longer, so they finish out of order.
    records = [{"domain": "echo", "x": i, "sleep": 0.05 * (5 - i)} for i in range(6)]
    records += [{"domain": "echo2", "x": 4}]
    results = pool.score(records, [f"c{i}" for i in range(7)])
    assert [r.score for r in results] == [0, 1, 2, 3, 4, 5, 0.5 * 4 + 0.25 * 4]
    assert all(r.status == "ok" for r in results)
    assert results[2].info == {"echo": {"score": 2.0, "completion": "c2"}}
    assert results[6].domain == "echo2" and set(results[6].info) == {"echo", "again"}


def test_hung_verifier_times_out_is_killed_and_pool_recovers(pool):
    records = [{"domain": "sleep_forever"}] + _echo_batch(4)[0]
    results = pool.score(records, ["x"] * 5)
    # "timeout" is only the pool's verdict at its deadline (no wall-clock bound is asserted:
    # CI machines are loaded); a pool without one would hang here.
    assert results[0].status == "timeout" and results[0].score == 0.0
    assert "worker killed" in results[0].info["error"]
    assert [r.score for r in results[1:]] == [0, 1, 2, 3]
    metrics = pool.metrics(reset=True)
    assert metrics["rewards/sleep_forever/timeouts"] == 1
    assert metrics["rewards/sleep_forever/score"] == 0.0
    assert metrics["rewards/echo/timeouts"] == 0 and metrics["rewards/echo/count"] == 4
    # The next batch runs on the replacement worker as usual.
    results = pool.score(*_echo_batch(6))
    assert [r.status for r in results] == ["ok"] * 6


def test_two_hung_verifiers_occupy_both_workers(pool):
    records = [{"domain": "sleep_forever"}] * 2 + _echo_batch(2)[0]
    results = pool.score(records, ["x"] * 4)
    # Both workers hang at once and are replaced; the echoes then run on the new workers.
    assert [r.status for r in results] == ["timeout", "timeout", "ok", "ok"]


def test_timeout_kills_processes_the_verifier_spawned(pool, tmp_path):
    pid_file = tmp_path / "child.pid"
    results = pool.score([{"domain": "spawns_and_hangs", "pid_file": str(pid_file)}], ["x"])
    assert results[0].status == "timeout"
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_pathological_math_is_cut_off_by_the_pool(pool):
    # math_verify's own alarms allow 5 s per step; the pool's 1 s deadline ends it first.
    records = [{"domain": "math", "answer": "2"}, {"domain": "math", "answer": "2"}]
    completions = [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{\sqrt{4}}"]
    results = pool.score(records, completions)
    assert [(r.status, r.score) for r in results] == [("timeout", 0.0), ("ok", 1.0)]
    assert "worker killed" in results[0].info["error"]  # the pool's deadline, not math_verify's


def test_raising_verifier_is_a_crash_and_the_worker_survives(pool):
    results = pool.score([{"domain": "raises"}, {"domain": "echo", "x": 3}], ["x", "y"])
    assert results[0].status == "crash" and results[0].score == 0.0
    assert results[0].info == {"error": "RuntimeError: verifier bug"}
    assert results[1].score == 3.0
    assert pool.metrics(reset=True)["rewards/raises/crashes"] == 1


def test_aborting_worker_is_a_crash_and_is_replaced(pool):
    records = [{"domain": "aborts"}] + _echo_batch(3)[0]
    results = pool.score(records, ["x"] * 4)
    assert results[0].status == "crash" and results[0].score == 0.0
    assert "SIGABRT" in results[0].info["error"]
    assert [r.score for r in results[1:]] == [0, 1, 2]
    assert pool.metrics(reset=True)["rewards/aborts/crashes"] == 1
    assert all(r.status == "ok" for r in pool.score(*_echo_batch(4)))


def test_unpicklable_info_is_a_crash(pool):
    results = pool.score([{"domain": "unpicklable_info"}], ["x"])
    assert results[0].status == "crash" and "does not pickle" in results[0].info["error"]


def test_bad_batches_fail_before_running(pool):
    with pytest.raises(ValueError, match=r"unknown reward domain.*'ecko' \(did you mean 'echo'"):
        pool.score([{"domain": "echo", "x": 0}, {"domain": "ecko"}], ["a", "b"])
    with pytest.raises(ValueError, match="no 'domain' field"):
        pool.score([{"x": 0}], ["a"])
    with pytest.raises(ValueError, match="2 records but 1 completions"):
        pool.score(*_echo_batch(2)[:1], ["a"])
    with pytest.raises(ValueError, match="cannot be sent"):
        pool.score([{"domain": "echo", "x": 0, "fn": lambda: 0}], ["a"])
    results = pool.score([{"x": 5}], ["a"], domains=["echo"])  # explicit domains
    assert results[0].score == 5.0
    assert pool.score([], []) == []


def test_a_large_batch_comes_back_in_order(pool):
    records, completions = _echo_batch(100)
    results = pool.score(records, completions)
    assert [r.score for r in results] == list(range(100))


def test_summarize_counts_per_domain(pool):
    results = pool.score([{"domain": "raises"}, {"domain": "echo", "x": 1}], ["a", "b"])
    metrics = summarize(results)
    assert metrics["rewards/echo/score"] == 1.0 and metrics["rewards/raises/crashes"] == 1
    assert set(metrics) == {
        f"rewards/{d}/{k}"
        for d in ("echo", "raises")
        for k in ("score", "count", "timeouts", "crashes", "seconds")
    }


def test_rejects_bad_settings():
    registry = RewardRegistry()
    with pytest.raises(ValueError, match="at least one worker"):
        RewardPool(registry, workers=0)
    with pytest.raises(ValueError, match="positive seconds"):
        RewardPool(registry, timeout_s=0)
    with pytest.raises(ValueError, match="fork"):
        RewardPool(registry, start_method="fork")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of the (also killed) worker is reparented and reaped by init; until then
    # it may linger as a zombie, which counts as dead.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


def test_worker_that_cannot_start_raises():
    registry = RewardRegistry()
    registry.register("broken", LoadsNowhere(), name="broken")
    with RewardPool(registry, workers=1) as pool:
        with pytest.raises(RuntimeError, match="died while starting"):
            pool.score([{"domain": "broken"}], ["x"])


def test_a_reward_returning_a_bare_float_is_counted_and_named(pool, caplog):
    """A reward function with the wrong return type scores 0 as a crash; RL's tally makes it
    the `reward_errors` share and warns once, with what the function must return."""
    from posttrain.rewards import component_means, tally_components

    results = pool.score([{"domain": "returns_a_float"}] * 3 + [{"domain": "echo", "x": 1}],
                         ["a", "b", "c", "d"])  # fmt: skip
    assert [r.status for r in results] == ["crash"] * 3 + ["ok"]
    totals = {}
    with caplog.at_level("WARNING", logger="posttrain.rl._domains"):
        tally_components(totals, results)
        tally_components(totals, results)  # (one warning per domain and kind of error)
    assert component_means(totals)["reward_errors"] == 0.75
    (warning,) = [r.message for r in caplog.records]
    assert "'returns_a_float'" in warning and "must return (score, info dict), got 0.5" in warning


def test_a_reward_worker_imports_no_jax():
    """A worker process imports the pool's module (and the rewards package): it must not pull
    in jax (~1 s and hundreds of modules per worker start); tracing is imported lazily."""
    import subprocess
    import sys

    program = "import sys, posttrain.rewards._pool; print('jax' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr[-2000:]
