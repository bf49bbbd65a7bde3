"""Verifier skipping (docs/METHODS.md §7): K^ per prefix gate, the guards, the D / S_max rule."""

from __future__ import annotations

import math

import pytest
import torch
from core_strategies import FAST, probabilities
from hypothesis import given
from hypothesis import strategies as st

from vllm_prove.core import (
    NO_FEASIBLE_PREFIX,
    GuardFlags,
    PrefixGate,
    SkipPolicy,
    accepted_prefix_length,
    feasible_prefix,
    guard_flags,
)


def _k_hat(scores, eta_b, eta_c, gate, n=None) -> int:
    tensor = torch.tensor([scores], dtype=torch.float32)
    lengths = torch.tensor([len(scores) if n is None else n])
    return feasible_prefix(tensor, lengths, eta_b, eta_c, gate).item()


@pytest.mark.parametrize(
    ("scores", "eta_b", "eta_c", "expected"),
    [
        # C = .99, .9698, .9494, ...; B drops to .5 at k = 4
        ([0.99, 0.95, 0.91, 0.5, 0.99], 0.90, 0.93, 3),
        ([0.99, 0.95, 0.91, 0.5, 0.99], 0.90, 0.96, 2),
        # C_2 = .9298 fails but C_3 = .9494, C_4 = .9594 pass: the literal max is 4
        ([0.95, 0.91, 0.99, 0.99], 0.90, 0.94, 4),
        ([0.85, 0.99, 0.99], 0.90, 0.50, NO_FEASIBLE_PREFIX),
    ],
)
def test_k_hat_geometric_mean(scores, eta_b, eta_c, expected):
    assert _k_hat(scores, eta_b, eta_c, PrefixGate.GEOMETRIC_MEAN) == expected


def test_k_hat_min_gate():
    # cummin = .95, .95, .92, .92: eta_c = .93 binds at k = 3
    assert _k_hat([0.95, 0.97, 0.92, 0.99], 0.90, 0.93, "min") == 2
    assert _k_hat([0.95, 0.97, 0.92, 0.99], 0.90, 0.90, "min") == 4
    assert _k_hat([0.95, 0.97, 0.92, 0.99], 0.96, 0.90, "min") == 0


def test_k_hat_product_gate_in_log_space():
    # prod = .99, .9801, .970299, .8733
    assert _k_hat([0.99, 0.99, 0.99, 0.9], 0.80, 0.97, "product") == 3
    assert _k_hat([0.99, 0.99, 0.99, 0.9], 0.80, 0.98, "product") == 2
    # the local gate binds first when eta_b > eta_c
    assert _k_hat([0.99, 0.99, 0.85, 0.99], 0.90, 0.50, "product") == 2
    # a long block: .9999^100 = .990049 >= .99 > .9999^101 = .989950
    assert _k_hat([0.9999] * 120, 0.9, 0.99, "product") == 100
    assert _k_hat([0.5] * 4, 0.0, 0.0, "product") == 4  # eta_c = 0: log 0 = -inf accepted


def test_k_hat_respects_num_draft_tokens_and_nan():
    assert _k_hat([0.99, 0.99, 0.99, 0.99], 0.9, 0.9, "geometric_mean", n=2) == 2
    assert _k_hat([0.99, math.nan, 0.99, 0.99], 0.9, 0.9, "geometric_mean") == 1
    assert _k_hat([0.99, math.nan, 0.99, 0.99], 0.9, 0.9, "product") == 1
    assert _k_hat([0.99, math.nan, 0.99, 0.99], 0.9, 0.9, "min") == 1


def test_k_hat_is_batched_per_row():
    scores = torch.tensor([[0.99, 0.99, 0.99], [0.5, 0.99, 0.99], [0.99, 0.99, 0.2]])
    got = feasible_prefix(scores, torch.tensor([3, 3, 3]), 0.9, 0.9, "geometric_mean")
    assert got.tolist() == [3, 0, 2]


@FAST
@given(st.lists(probabilities, min_size=1, max_size=10), probabilities, probabilities)
def test_min_gate_reduces_to_one_threshold(scores, eta_b, eta_c):
    # paper §4.2: for marginal survival both gates equal min_{j<=k} a_j,
    # so they reduce to one threshold eta_m = max(eta_b, eta_c)
    tensor = torch.tensor([scores], dtype=torch.float32)
    n = torch.tensor([len(scores)])
    got = feasible_prefix(tensor, n, eta_b, eta_c, "min")
    eta_m = torch.tensor(max(eta_b, eta_c), dtype=torch.float64)
    expected = accepted_prefix_length(tensor.double() >= eta_m, n)
    assert torch.equal(got, expected)


@FAST
@given(st.lists(st.floats(0.01, 1.0), min_size=1, max_size=10), probabilities, probabilities,
       st.sampled_from(list(PrefixGate)))
def test_k_hat_matches_the_formula(scores, eta_b, eta_c, gate):
    tensor = torch.tensor([scores], dtype=torch.float64)
    got = feasible_prefix(tensor, torch.tensor([len(scores)]), eta_b, eta_c, gate).item()
    expected = 0
    for k in range(1, len(scores) + 1):
        prefix = scores[:k]
        b_k = min(prefix)
        log_sum = sum(math.log(q) for q in prefix)
        c_ok = {
            PrefixGate.GEOMETRIC_MEAN: math.exp(log_sum / k) >= eta_c,
            PrefixGate.MIN: b_k >= eta_c,
            PrefixGate.PRODUCT: log_sum >= (math.log(eta_c) if eta_c > 0 else -math.inf),
        }[gate]
        if b_k >= eta_b and c_ok:
            expected = k
    # the tolerance of exp/log round-off decides only exact boundary cases
    assert got == expected or abs(got - expected) <= 1 and _near_boundary(scores, eta_c)


def _near_boundary(scores, eta_c) -> bool:
    logs = [math.log(q) for q in scores]
    sums = [sum(logs[:k]) for k in range(1, len(scores) + 1)]
    targets = [math.log(eta_c)] if eta_c > 0 else []
    return any(abs(s - t) < 1e-9 or abs(s / (i + 1) - t) < 1e-9
               for i, s in enumerate(sums) for t in targets)


def _guards(draft, scores, k_hat, **kwargs) -> GuardFlags:
    defaults = dict(special_token_ids=[0], max_new_tokens_left=100)
    defaults.update(kwargs)
    return guard_flags(torch.tensor(draft), torch.tensor(scores, dtype=torch.float32),
                       torch.tensor(k_hat), **defaults)


def test_guard_special_token_only_inside_prefix():
    draft = [[5, 0, 6, 7], [5, 6, 7, 0]]  # EOS (0) at position 2 / 4
    flags = _guards(draft, [[0.99] * 4] * 2, [3, 3])
    assert flags.special_token.tolist() == [True, False]
    assert flags.passed.tolist() == [False, True]


@pytest.mark.parametrize(
    ("draft", "k_hat", "expected"),
    [
        ([7, 7, 7, 7, 1, 2, 3, 4], 8, True),  # one token four times
        ([7, 7, 7, 1, 7, 7, 7, 2], 8, False),  # never four in a row
        ([3, 4, 3, 4, 3, 4, 3, 4], 8, True),  # a bigram four times
        ([3, 4, 3, 4, 3, 4, 1, 2], 8, False),  # a bigram only three times
        ([1, 2, 3, 7, 7, 7, 7, 9], 6, False),  # the run ends past K^
        ([1, 2, 3, 7, 7, 7, 7, 9], 7, True),
    ],
)
def test_guard_repetition(draft, k_hat, expected):
    flags = _guards([draft], [[0.99] * 8], [k_hat])
    assert flags.repetition.tolist() == [expected]


def test_guard_repetition_longer_ngram_needs_window():
    trigram = [1, 2, 3] * 4  # twelve tokens
    flags = _guards([trigram], [[0.99] * 12], [12])
    assert flags.repetition.tolist() == [True]
    flags = _guards([trigram], [[0.99] * 12], [12], repetition_ngram=2)
    assert flags.repetition.tolist() == [False]


def test_guard_invalid_scores():
    scores = [[0.9, math.nan, 0.9, 0.9], [0.9, 0.9, 1.5, 0.9], [0.9, 0.9, 0.9, -0.1],
              [0.9, 0.9, 0.9, math.inf], [0.9, 0.9, 0.9, 0.9]]
    flags = _guards([[1, 2, 3, 4]] * 5, scores, [1, 2, 3, 3, 4])
    assert flags.invalid_scores.tolist() == [True, True, True, True, False]
    # a NaN in padding past num_draft_tokens is ignored
    flags = _guards([[1, 2, 3, 4]], [[0.9, 0.9, math.nan, math.nan]], [2],
                    num_draft_tokens=torch.tensor([2]), max_new_tokens_left=100)
    assert flags.invalid_scores.tolist() == [False]


def test_guard_shortened_final_block():
    flags = _guards([[1, 2, 3, 4]] * 3, [[0.9] * 4] * 3, [2, 2, 2],
                    max_new_tokens_left=torch.tensor([100, 3, 4]))
    assert flags.shortened_block.tolist() == [False, True, False]
    flags = _guards([[1, 2, 3, 4]] * 2, [[0.9] * 4] * 2, [2, 2],
                    num_draft_tokens=torch.tensor([4, 3]))
    assert flags.shortened_block.tolist() == [False, True]


POLICY = SkipPolicy(K_min=6, S_max=25, eta_b=0.9, eta_c=0.93, gate="geometric_mean")


def _decide(k_hat, unverified, passed, policy=POLICY):
    return policy.decide(torch.tensor(k_hat), torch.tensor(unverified), torch.tensor(passed))


def test_decide_skip_conditions():
    decision = _decide([10, 5, 0, 10, 10], [0, 0, 0, 0, 24], [True, True, True, False, True])
    assert decision.skip.tolist() == [True, False, False, False, True]
    assert decision.num_committed.tolist() == [10, 0, 0, 0, 10]
    assert decision.unverified_after.tolist() == [10, 0, 0, 0, 34]  # D may pass S_max
    assert decision.forced_strict.tolist() == [False] * 5


def test_decide_forces_strict_round_at_s_max():
    decision = _decide([10, 10], [25, 40], [True, True])
    assert decision.forced_strict.tolist() == [True, True]
    assert decision.skip.tolist() == [False, False]
    assert decision.unverified_after.tolist() == [0, 0]  # the verifier call resets D


def test_decide_k_min_zero_still_needs_a_prefix():
    policy = SkipPolicy(K_min=0, S_max=64)
    decision = _decide([0, 1], [0, 0], [True, True], policy)
    assert decision.skip.tolist() == [False, True]


def test_decide_accepts_guard_flags():
    flags = GuardFlags(torch.tensor([False, True]), torch.tensor([False, False]),
                       torch.tensor([False, False]), torch.tensor([False, False]))
    decision = POLICY.decide(torch.tensor([8, 8]), torch.tensor([0, 0]), flags)
    assert decision.skip.tolist() == [True, False]
    assert GuardFlags.make_dummy(3).passed.tolist() == [True, True, True]


def test_staleness_over_rounds():
    # K^ = 10 every round, S_max = 25: skip, skip, skip (D 20 < 25), forced strict, skip.
    unverified = torch.tensor([0])
    history = []
    for _ in range(5):
        decision = POLICY.decide(torch.tensor([10]), unverified, torch.tensor([True]))
        history.append((decision.skip.item(), decision.unverified_after.item()))
        unverified = decision.unverified_after
    assert history == [(True, 10), (True, 20), (True, 30), (False, 0), (True, 10)]


def test_policy_feasible_prefix_uses_its_config():
    scores = torch.tensor([[0.99, 0.95, 0.91, 0.5, 0.99]])
    assert POLICY.feasible_prefix(scores, torch.tensor([5])).tolist() == [3]


@pytest.mark.parametrize(
    ("field", "value"),
    [("K_min", -1), ("S_max", 0), ("eta_b", 1.5), ("eta_c", -0.1), ("gate", "median")],
)
def test_policy_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SkipPolicy(**{field: value})


def test_geometric_mean_accepts_an_exact_tie():
    """A one-token prefix whose score equals eta_c is feasible (exp(log x) < x for some x:
    the comparison must stay in log space)."""
    import torch

    from vllm_prove.core.skip_policy import PrefixGate, feasible_prefix

    for x in (0.003, 0.1, 0.3, 0.7, 0.93):
        scores = torch.tensor([[x, 0.0]], dtype=torch.float64)
        k = feasible_prefix(scores, torch.tensor([2]), eta_b=0.0, eta_c=x, prefix_gate=PrefixGate.GEOMETRIC_MEAN)
        assert k.tolist() == [1], x
