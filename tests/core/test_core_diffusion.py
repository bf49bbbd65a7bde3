"""The drafter's reveal schedule, reveal choice and survival features (docs/METHODS.md §7)."""

from __future__ import annotations

import pytest
import torch

from vllm_prove.core.diffusion import (NUM_SCALAR_FEATURES, SCALAR_FEATURES, distribution_stats, reveal_counts,
                                       scalar_features, select_reveals)


@pytest.mark.parametrize("gamma,steps,expected", [(32, 2, [16, 16]), (5, 2, [3, 2]), (4, 4, [1, 1, 1, 1]),
                                                  (7, 1, [7]), (10, 3, [4, 3, 3])])
def test_reveal_counts_split_gamma(gamma, steps, expected):
    assert reveal_counts(gamma, steps) == expected


@pytest.mark.parametrize("steps", [0, 9])
def test_reveal_counts_rejects_impossible_schedules(steps):
    with pytest.raises(ValueError, match="steps must lie in"):
        reveal_counts(8, steps)


def test_select_reveals_takes_the_most_confident_masked_positions():
    conf = torch.tensor([[0.1, 0.9, 0.5, 0.9, 0.7],
                         [0.8, 0.2, 0.3, 0.4, 0.1]])
    masked = torch.tensor([[True, True, True, True, True],
                           [False, True, True, True, True]])  # row 1: position 0 already revealed
    got = select_reveals(conf, masked, 2)
    # row 0: the two 0.9s (a tie is no reason to skip either); row 1: 0.4 and 0.3, never the revealed 0.8
    assert got.tolist() == [[False, True, False, True, False], [False, False, True, True, False]]


def test_select_reveals_breaks_ties_towards_the_earlier_position_and_caps_at_what_is_masked():
    conf = torch.full((1, 4), 0.5)
    assert select_reveals(conf, torch.ones(1, 4, dtype=torch.bool), 1).tolist() == [[True, False, False, False]]
    masked = torch.tensor([[False, True, False, False]])
    assert select_reveals(conf, masked, 3).tolist() == [[False, True, False, False]]


def test_distribution_stats_golden():
    probs = torch.tensor([[[0.5, 0.3, 0.2, 0.0, 0.0, 0.0]]])
    s = distribution_stats(probs)
    assert s["token"].item() == 0
    assert s["top1_prob"].item() == pytest.approx(0.5)
    assert s["margin"].item() == pytest.approx(0.2)
    assert s["top5_mass"].item() == pytest.approx(1.0)
    h = -(0.5 * torch.log(torch.tensor(0.5)) + 0.3 * torch.log(torch.tensor(0.3)) + 0.2 * torch.log(torch.tensor(0.2)))
    assert s["entropy"].item() == pytest.approx(h.item(), rel=1e-5)


def test_scalar_features_golden():
    # one row, gamma 4, T 2: positions 1 and 3 revealed at step 0, positions 0 and 2 at step 1
    reveal = {"top1_prob": torch.tensor([[0.6, 0.9, 0.5, 0.8]]), "entropy": torch.tensor([[1.0, 0.2, 1.5, 0.4]]),
              "margin": torch.tensor([[0.3, 0.85, 0.1, 0.7]]), "top5_mass": torch.tensor([[0.9, 1.0, 0.8, 1.0]])}
    first = {"top1_prob": torch.tensor([[0.4, 0.9, 0.3, 0.8]]), "entropy": torch.tensor([[2.0, 0.2, 2.5, 0.4]]),
             "margin": torch.zeros(1, 4), "top5_mass": torch.zeros(1, 4)}
    step = torch.tensor([[1, 0, 1, 0]])
    rank = torch.tensor([[2, 0, 3, 1]])
    f = scalar_features(reveal, first, step, rank, torch.tensor([10]), max_new_tokens=40, steps=2, dataset="code")
    assert f.shape == (1, 4, NUM_SCALAR_FEATURES) == (1, 4, len(SCALAR_FEATURES))
    col = {name: f[0, :, i].tolist() for i, name in enumerate(SCALAR_FEATURES)}
    assert col["reveal_step"] == [1, 0, 1, 0]
    assert col["reveal_rank"] == pytest.approx([2 / 3, 0, 1, 1 / 3])
    assert col["reveal_parallelism"] == [0.5] * 4
    assert col["late_reveal"] == [1, 0, 1, 0]
    assert col["delta_top1_prob"] == pytest.approx([0.2, 0.0, 0.2, 0.0])
    assert col["delta_neg_entropy"] == pytest.approx([1.0, 0.0, 1.0, 0.0])
    assert col["block_position"] == [0, 0.25, 0.5, 0.75]
    assert col["segment_position"] == [0.25] * 4
    assert col["generated_length"] == pytest.approx([torch.log1p(torch.tensor(10.0)).item()] * 4)
    assert col["is_code"] == [1] * 4 and col["is_math"] == [0] * 4
