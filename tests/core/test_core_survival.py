"""Survival labels, prompt folds and the permutation diagnostic (docs/METHODS.md §7)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from vllm_prove.core.skip_policy import PrefixGate, feasible_prefix
from vllm_prove.core.survival import (
    FoldRotation,
    SurvivalSignal,
    fold_assignment,
    permutation_diagnostic,
    rotation,
    survival_labels,
)

# Hand-made rounds with block 5: (L, n) = (0, 5), (2, 5), (5, 5), (1, 3), (3, 3), (0, 0)
ACCEPTED = torch.tensor([0, 2, 5, 1, 3, 0])
NUM_DRAFT = torch.tensor([5, 5, 5, 3, 3, 0])


def test_marginal_labels_golden():
    labels, mask = survival_labels(ACCEPTED, NUM_DRAFT, 5, "marginal")
    assert labels.tolist() == [
        [0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 0, 0],
    ]
    # every valid position of every block, nothing past n
    assert mask.int().tolist() == [
        [1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 0, 0],
    ]
    assert labels.dtype == torch.float32 and mask.dtype == torch.bool


def test_conditional_labels_golden():
    labels, mask = survival_labels(ACCEPTED, NUM_DRAFT, 5, SurvivalSignal.CONDITIONAL)
    # positives j <= L, one negative at j = L + 1 when L < n, later positions masked
    assert mask.int().tolist() == [
        [1, 0, 0, 0, 0],  # L = 0: only the rejection at j = 1
        [1, 1, 1, 0, 0],  # L = 2: two survivals, rejection at j = 3
        [1, 1, 1, 1, 1],  # L = n: no negative
        [1, 1, 0, 0, 0],  # L = 1 < n = 3
        [1, 1, 1, 0, 0],  # L = n = 3
        [0, 0, 0, 0, 0],  # n = 0: nothing
    ]
    assert labels[mask].tolist() == [0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1]
    assert not labels[~mask].any()  # masked-out positions carry 0


def test_labels_reject_inconsistent_lengths():
    with pytest.raises(ValueError, match="accepted"):
        survival_labels(torch.tensor([4]), torch.tensor([3]), 5, "marginal")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        survival_labels(torch.tensor([1]), torch.tensor([6]), 5, "marginal")
    with pytest.raises(ValueError):
        survival_labels(ACCEPTED, NUM_DRAFT, 5, "joint")


def test_signal_prefix_gates():
    assert SurvivalSignal.MARGINAL.prefix_gate is PrefixGate.MIN
    assert SurvivalSignal.CONDITIONAL.prefix_gate is PrefixGate.PRODUCT


def test_fold_assignment_golden_and_deterministic():
    ids = torch.arange(10)
    expected = list(range(10))
    random.Random(12345).shuffle(expected)  # the documented procedure, by hand
    folds = fold_assignment(ids)
    assert folds.tolist() == [expected.index(i) // 2 for i in range(10)]
    assert folds.tolist() == [4, 2, 2, 1, 3, 1, 4, 0, 0, 3]  # pinned: a changed shuffle fails
    assert torch.equal(fold_assignment(ids), folds)
    assert not torch.equal(fold_assignment(ids, seed=1), folds)


def test_fold_assignment_disjoint_and_covering():
    gen = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(100, 160, (500,), generator=gen)  # repeated, unsorted ids
    folds = fold_assignment(prompt_ids)
    distinct = torch.unique(prompt_ids)
    fold_of = {}
    for pid, fold in zip(prompt_ids.tolist(), folds.tolist()):
        assert fold_of.setdefault(pid, fold) == fold  # one prompt, one fold
    assert set(fold_of) == set(distinct.tolist())  # every prompt assigned
    sizes = [sum(1 for f in fold_of.values() if f == k) for k in range(5)]
    assert sorted(set(fold_of.values())) == [0, 1, 2, 3, 4]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == distinct.numel()
    # rows of a prompt follow it whatever the row order
    perm = torch.randperm(500, generator=gen)
    assert torch.equal(fold_assignment(prompt_ids[perm]), folds[perm])
    with pytest.raises(ValueError, match="distinct prompt ids"):
        fold_assignment(torch.tensor([1, 2, 3, 3]))


@pytest.mark.parametrize(
    ("r", "expected"),
    [(0, ((2, 3, 4), 1, 0)), (3, ((0, 1, 2), 4, 3)), (4, ((1, 2, 3), 0, 4))],
)
def test_rotation_golden(r, expected):
    assert rotation(r) == FoldRotation(*expected)
    assert rotation(r).validation == expected[1]


def test_rotations_partition_the_folds():
    for r in range(5):
        rot = rotation(r)
        assert sorted([*rot.train, rot.validation, rot.test]) == [0, 1, 2, 3, 4]
    assert sorted(rotation(r).test for r in range(5)) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        rotation(5)


def _dependent_blocks(num_each: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    # good rounds: every score .99 and all accepted; bad rounds: every score .5, nothing accepted
    scores = torch.cat([torch.full((num_each, block), 0.99), torch.full((num_each, block), 0.5)])
    accepted = torch.cat([torch.full((num_each,), block), torch.zeros(num_each, dtype=torch.int64)])
    return scores, accepted


def test_permutation_breaks_within_block_dependence():
    block, num_each = 8, 20
    scores, accepted = _dependent_blocks(num_each, block)
    n = torch.full((2 * num_each,), block)
    diag = permutation_diagnostic(scores, accepted, n, 0.9, 0.9, "geometric_mean", 100, seed=3)
    assert diag.mean_prefix_realized == block / 2  # good rounds K^ = 8, bad rounds 0
    # a permuted round is good at each position with prob. 1/2 independently:
    # E[K^] = sum_{k=1..8} 2^-k = 0.996; sd of the mean over 4,000 rounds ~ 0.02
    assert abs(diag.mean_prefix_permuted - (1 - 2**-block)) < 0.1
    # each score keeps its own label: every committed token is still accepted
    assert diag.strict_token_realized == diag.strict_token_permuted == 1.0
    assert diag.full_prefix_realized == diag.full_prefix_permuted == 1.0
    assert diag.repeats == 100
    again = permutation_diagnostic(scores, accepted, n, 0.9, 0.9, "geometric_mean", 100, seed=3)
    assert again == diag  # seeded


def test_permutation_moves_labels_with_scores():
    # scores all high (K^ = block on every round) but half the rounds accept nothing: the
    # permuted L' is the leading run of independent fair coins, E[L'] ~ 1
    block, num_each = 8, 20
    scores = torch.full((2 * num_each, block), 0.99)
    _, accepted = _dependent_blocks(num_each, block)
    n = torch.full((2 * num_each,), block)
    diag = permutation_diagnostic(scores, accepted, n, 0.9, 0.9, "min", 100, seed=0)
    assert diag.mean_prefix_realized == diag.mean_prefix_permuted == block
    assert diag.strict_token_realized == 0.5 and diag.full_prefix_realized == 0.5
    assert abs(diag.strict_token_permuted - (1 - 2**-block) / block) < 0.02
    assert diag.full_prefix_permuted < 0.02  # 2^-8 = 0.004 in expectation


def test_permutation_of_identical_blocks_changes_nothing():
    row = torch.tensor([0.99, 0.97, 0.95, 0.6, 0.99, 0.99])
    scores = row.repeat(7, 1)  # [batch, block]
    accepted, n = torch.full((7,), 4), torch.full((7,), 6)
    for gate in ("geometric_mean", "min", "product"):
        diag = permutation_diagnostic(scores, accepted, n, 0.5, 0.8, gate, repeats=20)
        expected = feasible_prefix(scores, n, 0.5, 0.8, gate).double().mean().item()
        assert diag.mean_prefix_realized == diag.mean_prefix_permuted == expected
        assert diag.strict_token_realized == diag.strict_token_permuted
        assert diag.full_prefix_realized == diag.full_prefix_permuted


def test_permutation_carries_validity_and_reports_nan_without_a_prefix():
    # row 1 has n = 2: columns 3 and 4 each hold one invalid position, permuted independently.
    # Aligned (prob. 1/2): n' = 4 and 2, mean 3; split: n' = 3 and 2, mean 2.5. E = 2.75.
    scores = torch.full((2, 4), 0.99)
    accepted, n = torch.tensor([4, 2]), torch.tensor([4, 2])
    diag = permutation_diagnostic(scores, accepted, n, 0.9, 0.9, "min", repeats=200, seed=1)
    assert diag.mean_prefix_realized == 3.0
    assert abs(diag.mean_prefix_permuted - 2.75) < 0.06  # sd of the mean over 200: 0.018
    assert diag.full_prefix_permuted == 1.0  # L' = n' always: labels travel with validity
    none = permutation_diagnostic(torch.full((3, 4), 0.1), torch.zeros(3, dtype=torch.int64),
                                  torch.full((3,), 4), 0.9, 0.9, "min", repeats=5)
    assert none.mean_prefix_realized == none.mean_prefix_permuted == 0.0
    assert math.isnan(none.strict_token_realized) and math.isnan(none.full_prefix_permuted)
    with pytest.raises(ValueError, match="repeats"):
        permutation_diagnostic(scores, accepted, n, 0.9, 0.9, "min", repeats=0)
