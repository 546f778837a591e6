"""The eval suite's Scorer: a verifier that raises scores 0, is counted, and is logged once per
domain and kind of error (not once per batch, nor twice for one failure)."""

import logging

from posttrain.eval import EvalConfig, TargetTask
from posttrain.eval._tasks import Scorer


def broken(record, completion):
    raise KeyError("answer")


def test_a_failing_verifier_scores_zero_is_counted_and_warns_once(caplog):
    config = EvalConfig(target=(TargetTask("t", path="unused.jsonl"),),
                        rewards={"flaky": f"{__name__}:broken"})  # fmt: skip
    scorer = Scorer(config)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            scores = scorer([{"answer": "1"}] * 3, ["1", "2", "3"], ["flaky"] * 3)
            assert scores.tolist() == [0.0, 0.0, 0.0]
    assert scorer.failures == 6
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'flaky' failed" in warnings[0], warnings
    assert "KeyError" in warnings[0] and "reward_errors" in warnings[0]
