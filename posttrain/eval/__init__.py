"""Evaluation: exact-match accuracy (periodic and offline harnesses arrive with issue #10)."""

from posttrain.eval._exact_match import greedy_exact_match

__all__ = ["greedy_exact_match"]
