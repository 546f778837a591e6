"""Evaluation: a suite of general (held-out loss), target (accuracy by verifier, pass@k,
preferences) and safety (refusal / compliance) tasks, on one model or every checkpoint of a run.

    config = load_eval_config("configs/eval.py:demo")
    metrics = evaluate(model, tokenizer, config)           # {"target/arithmetic/accuracy": ...}
    evaluate_checkpoints("runs/demo/sft", config)          # writes runs/demo/sft/eval/table.md
"""

from posttrain.eval._config import (
    EvalConfig,
    GeneralTask,
    SafetyTask,
    TargetTask,
    check_files,
    load_eval_config,
)
from posttrain.eval._exact_match import greedy_exact_match
from posttrain.eval._harness import (
    checkpoint_steps,
    evaluate,
    evaluate_checkpoints,
    print_tables,
    suite_evaluator,
    write_report,
)
from posttrain.eval._preference import preference_wins, prefers_chosen
from posttrain.eval._refusal import REFUSAL_PHRASES, SAFETY_RUBRIC, RefusalDetector
from posttrain.eval._tasks import Scorer

__all__ = [
    "REFUSAL_PHRASES",
    "SAFETY_RUBRIC",
    "EvalConfig",
    "GeneralTask",
    "RefusalDetector",
    "SafetyTask",
    "Scorer",
    "TargetTask",
    "check_files",
    "checkpoint_steps",
    "evaluate",
    "evaluate_checkpoints",
    "greedy_exact_match",
    "load_eval_config",
    "preference_wins",
    "prefers_chosen",
    "print_tables",
    "suite_evaluator",
    "write_report",
]
