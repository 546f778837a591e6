"""The bundled demo task: arithmetic chats, their verifier, and the tiny tokenizer and datasets.

`make demo` fine-tunes the `tiny` model from scratch on `ASSETS_DIR/train.jsonl` and measures
exact-match accuracy on `ASSETS_DIR/eval.jsonl` with `is_correct`; DPO and RL reuse the verifier.
"""

from posttrain.demo._assets import ASSETS_DIR, build_assets, build_tokenizer
from posttrain.demo._task import make_dataset, make_problem, problem_key

# The verifier is a reward like the others (rewards sit below the demo and cannot import it).
from posttrain.rewards import extract_integer as extract_answer
from posttrain.rewards import integer_correct as is_correct

__all__ = [
    "ASSETS_DIR",
    "build_assets",
    "build_cad_assets",
    "build_calculator_assets",
    "build_clarify_assets",
    "build_retrieval_assets",
    "build_tokenizer",
    "extract_answer",
    "greedy_accuracy",
    "is_correct",
    "make_dataset",
    "make_problem",
    "make_problems",
    "preference_pairs",
    "problem_key",
    "run_cad_demo",
    "run_calculator_demo",
    "run_clarify_demo",
    "run_retrieval_demo",
    "run_demo",
    "write_task",
]


def __getattr__(name):
    # The runner imports jax and the trainer; load it only when asked for, so the task and
    # verifier stay light to import (reward workers, tests).
    if name in ("run_demo", "preference_pairs"):
        from posttrain.demo import _run

        return getattr(_run, name)
    if name in ("run_calculator_demo", "build_calculator_assets", "make_problems"):
        from posttrain.demo import _calculator

        return getattr(_calculator, name)
    if name in ("greedy_accuracy", "write_task"):  # the shapes task (notebook 06)
        from posttrain.demo import _shapes

        return getattr(_shapes, name)
    if name in ("build_clarify_assets", "run_clarify_demo"):
        from posttrain.demo import _clarify

        return getattr(_clarify, name)
    if name in ("build_retrieval_assets", "run_retrieval_demo"):
        from posttrain.demo import _retrieval

        return getattr(_retrieval, name)
    if name in ("build_cad_assets", "run_cad_demo"):
        from posttrain.demo import _cad

        return getattr(_cad, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
