"""Prompt difficulty: pass@k against the closed form, pass rates, filtering, stratification."""

import itertools
from math import comb

import pytest

from posttrain.curate import stratify
from posttrain.rewards import filter_by_pass_rate, pass_at_k, pass_rate


@pytest.mark.parametrize("n", [1, 2, 5, 10])
def test_pass_at_k_matches_closed_form(n):
    for c, k in itertools.product(range(n + 1), range(1, n + 1)):
        assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


def test_pass_at_k_by_enumeration():
    # pass@2 from 4 samples with 1 pass: the chance a random pair holds it is 3/6.
    samples = [1, 0, 0, 0]
    pairs = list(itertools.combinations(samples, 2))
    assert pass_at_k(4, 1, 2) == pytest.approx(sum(map(max, pairs)) / len(pairs)) == 0.5
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(200, 0, 100) == 0.0 and pass_at_k(200, 101, 100) == 1.0
    assert 0.0 < pass_at_k(1000, 1, 500) <= 1.0  # no overflow at large n


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_bad_counts(n, c, k):
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(n, c, k)


def test_pass_rate_threshold_and_keys():
    scores = {"easy": [1, 1, 1, 1], "mid": [1, 0, 0.9, 0], "hard": [0, 0, 0.2, 0]}
    assert pass_rate(scores) == {"easy": 1.0, "mid": 0.5, "hard": 0.0}
    assert pass_rate(scores, threshold=1.0) == {"easy": 1.0, "mid": 0.25, "hard": 0.0}
    assert pass_rate([[1, 0], [0.5]]) == {0: 0.5, 1: 1.0}  # a list is keyed by position
    with pytest.raises(ValueError, match="no scored samples"):
        pass_rate({"empty": []})


def test_filter_drops_all_pass_and_all_fail():
    scores = {"a": [1, 1, 1], "b": [1, 0, 1], "c": [0, 0, 0], "d": [0, 0, 1]}
    assert filter_by_pass_rate(scores) == ["b", "d"]
    assert filter_by_pass_rate(scores, max_rate=0.5) == ["d"]
    assert filter_by_pass_rate(scores, min_rate=0.4) == ["b"]
    # GRPO-style groups as lists: a reward of -1/1 passes at threshold 0.
    groups = [[-1, -1], [1, -1], [1, 1]]
    assert filter_by_pass_rate(groups, threshold=0.0) == [1]


def test_stratify_quantile_buckets_hardest_first():
    rates = {f"p{i}": r for i, r in enumerate([0.9, 0.1, 0.5, 0.0, 1.0, 0.3, 0.7])}
    buckets = stratify(rates, num_buckets=3)
    assert buckets == [["p3", "p1", "p5"], ["p2", "p6"], ["p0", "p4"]]
    assert sorted(sum(buckets, [])) == sorted(rates)
    # Ties keep input order; more buckets than prompts leaves some empty.
    assert stratify({"a": 0.5, "b": 0.5, "c": 0.5}, num_buckets=2) == [["a", "b"], ["c"]]
    assert stratify({"a": 0.5}, num_buckets=3) == [["a"], [], []]


def test_stratify_fixed_edges():
    rates = {"a": 0.0, "b": 0.2, "c": 0.5, "d": 0.8, "e": 1.0}
    assert stratify(rates, edges=(0.2, 0.8)) == [["a"], ["b", "c"], ["d", "e"]]
    with pytest.raises(ValueError, match="strictly increasing"):
        stratify(rates, edges=(0.8, 0.2))
    with pytest.raises(ValueError, match="num_buckets >= 1"):
        stratify(rates, num_buckets=0)


def test_stratify_from_sampled_scores():
    scores = {"q1": [1, 1, 1, 0], "q2": [0, 0, 0, 0], "q3": [1, 0, 0, 0], "q4": [1, 1, 0, 0]}
    hard, easy = stratify(pass_rate(scores), num_buckets=2)
    assert hard == ["q2", "q3"] and easy == ["q4", "q1"]
