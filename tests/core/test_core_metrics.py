"""Metrics: histogram, AR-matching prefix, AUC, throughput, SDD agreement, CycleStats."""

from __future__ import annotations

import itertools

import pytest
import torch
from core_strategies import FAST
from hypothesis import given
from hypothesis import strategies as st

from vllm_prove.core import (
    CycleStats,
    Verdict,
    ar_matching_prefix_length,
    auc,
    committed_histogram,
    full_prefix_acceptance,
    mean_committed_per_cycle,
    strict_token_agreement,
    throughput,
)


def test_committed_histogram_and_mean():
    counts = torch.tensor([3, 1, 5, 3])
    assert committed_histogram(counts) == {1: 1, 3: 2, 5: 1}
    assert list(committed_histogram(counts)) == [1, 3, 5]  # sorted by length
    assert mean_committed_per_cycle(counts) == 3.0
    assert mean_committed_per_cycle([2, 3]) == 2.5
    with pytest.raises(ValueError, match="empty"):
        mean_committed_per_cycle([])


def test_ar_matching_prefix_length():
    draft = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4], [7, 2, 3, 4], [1, 2, -1, -1]])
    ar = torch.tensor([[1, 2, 3, 4, 5]] * 4)  # wider than the block is fine
    got = ar_matching_prefix_length(draft, torch.tensor([4, 4, 4, 2]), ar)
    assert got.tolist() == [4, 1, 0, 2]
    with pytest.raises(ValueError, match="block=4"):
        ar_matching_prefix_length(draft, torch.tensor([4] * 4), ar[:, :3])


@pytest.mark.parametrize(
    ("scores", "labels", "expected"),
    [
        ([0.1, 0.2, 0.3, 0.4], [0, 0, 1, 1], 1.0),  # perfect
        ([0.4, 0.3, 0.2, 0.1], [0, 0, 1, 1], 0.0),  # reversed
        ([0.5, 0.5, 0.5, 0.5], [0, 1, 0, 1], 0.5),  # all tied
        ([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1], 0.75),  # sklearn's doc example
        ([0.5, 0.5, 0.9, 0.1], [1, 0, 1, 0], 0.875),  # one tie counts one half: 3.5 / 4
    ],
)
def test_auc_golden(scores, labels, expected):
    assert auc(scores, labels) == pytest.approx(expected, abs=1e-12)


def test_auc_accepts_bool_tensors():
    assert auc(torch.tensor([0.2, 0.9]), torch.tensor([False, True])) == 1.0


@pytest.mark.parametrize(
    ("scores", "labels", "message"),
    [
        ([0.1, 0.2], [1, 1], "both classes.*positive"),
        ([0.1, 0.2], [0, 0], "both classes.*negative"),
        ([0.1, float("nan")], [0, 1], "NaN"),
        ([0.1, 0.2], [0, 1, 1], "differ in length"),
        ([0.1, 0.2], [0, 2], "0/1"),
        ([], [], "empty"),
    ],
)
def test_auc_rejects_bad_input(scores, labels, message):
    with pytest.raises(ValueError, match=message):
        auc(scores, labels)


@FAST
@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=2, max_size=30))
def test_auc_equals_pairwise_probability(pairs):
    scores = [float(s) for s, _ in pairs]  # few distinct values: many ties
    labels = [int(y) for _, y in pairs]
    positives = [s for s, y in zip(scores, labels) if y]
    negatives = [s for s, y in zip(scores, labels) if not y]
    if not positives or not negatives:
        with pytest.raises(ValueError):
            auc(scores, labels)
        return
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0
               for p, n in itertools.product(positives, negatives))
    assert auc(scores, labels) == pytest.approx(wins / (len(positives) * len(negatives)))


def test_throughput_is_total_over_total():
    # two requests: 100 tokens in 1 s and 10 tokens in 9 s. The mean of their rates would
    # be (100 + 1.11) / 2 = 50.6 tok/s; the rule is 110 / 10.
    assert throughput(110, 10.0) == 11.0
    with pytest.raises(ValueError, match="total_seconds"):
        throughput(5, 0.0)
    with pytest.raises(ValueError, match="total_tokens"):
        throughput(-1, 1.0)


def test_sdd_agreement_metrics():
    committed = [6, 8, 0, 10]  # the K_b = 0 round is a strict round: excluded from A
    strict = [6, 5, 3, 12]
    assert strict_token_agreement(committed, strict) == pytest.approx((6 + 5 + 10) / 24)
    assert full_prefix_acceptance(committed, strict) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="nonempty"):
        strict_token_agreement([0, 0], [1, 2])
    with pytest.raises(ValueError, match="differ in length"):
        full_prefix_acceptance([1, 2], [1])


def test_cycle_stats_summary():
    stats = CycleStats()
    assert stats.summary()["cycles"] == 0
    draft = torch.tensor([[1, 2, 3], [4, 5, 6]])
    stats.record(Verdict.from_prefix(draft, torch.tensor([3, 0]), torch.tensor([9, 9])))
    stats.record_counts([2])
    stats.add_time(0.5)
    summary = stats.summary()
    assert summary["cycles"] == 3
    assert summary["total_tokens"] == 4 + 1 + 2
    assert summary["histogram"] == {1: 1, 2: 1, 4: 1}
    assert summary["mean_committed_per_cycle"] == pytest.approx(7 / 3)
    assert summary["tokens_per_second"] == pytest.approx(14.0)
    with pytest.raises(ValueError, match="seconds"):
        stats.add_time(-1.0)


def test_common_prefix_length_counts_leading_agreement_only():
    from vllm_prove.core.metrics import common_prefix_length

    assert common_prefix_length([1, 2, 3, 9], [1, 2, 4, 9]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([5, 1], [6, 1]) == 0
