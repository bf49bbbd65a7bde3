"""Load-adaptive speculation depth (vllm_prove/core/adaptive.py): golden cases, the exact optimum
against brute force, the online cost fit and the acceptance estimates."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_prove.core.adaptive import (AcceptanceTracker, StepCost, StepCostModel, choose_depths,
                                      expected_committed)


def test_expected_committed_golden():
    e = expected_committed(torch.tensor([[0.5, 0.5, 1.0], [1.0, 1.0, 1.0], [0.0, 0.9, 0.9]]))
    torch.testing.assert_close(e, torch.tensor([[1.0, 1.5, 1.75, 2.0], [1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0]],
                                               dtype=torch.float64))


def test_free_rows_speculate_fully_and_dear_rows_not_at_all():
    e = expected_committed(torch.full((3, 8), 0.7))
    assert choose_depths(e, StepCost(c_0=1.0, c_req=0.1, c_row=0.0)).tolist() == [8, 8, 8]
    assert choose_depths(e, StepCost(c_0=1.0, c_req=0.1, c_row=1e-9)).tolist() == [8, 8, 8]
    # a position nobody accepts adds rows and no tokens: never worth it, even when rows are free
    flat = expected_committed(torch.tensor([[0.9, 0.9, 0.0, 0.0]]))
    assert choose_depths(flat, StepCost(c_0=1.0, c_req=0.1, c_row=1e-6)).tolist() == [2]
    assert choose_depths(e, StepCost(c_0=0.01, c_req=0.01, c_row=10.0)).tolist() == [0, 0, 0]


def test_requests_that_accept_more_speculate_deeper():
    accept = torch.tensor([[0.95] * 8, [0.2] * 8])
    k = choose_depths(expected_committed(accept), StepCost(c_0=1.0, c_req=0.05, c_row=0.08))
    assert k[0] > k[1]


def test_gated_requests_take_a_full_window_or_none():
    e = expected_committed(torch.tensor([[0.9] * 8, [0.1] * 8]))
    allowed = torch.zeros(2, 9, dtype=torch.bool)
    allowed[:, 8] = True
    k = choose_depths(e, StepCost(c_0=1.0, c_req=0.05, c_row=0.1), allowed)
    assert k.tolist() == [8, 0]


def _brute_force(e, cost, allowed):
    best, arg = -1.0, None
    options = [[k for k in range(e.shape[1]) if k == 0 or allowed[r, k]] for r in range(e.shape[0])]
    for combo in itertools.product(*options):
        rate = sum(float(e[r, k]) for r, k in enumerate(combo)) / cost(e.shape[0] + sum(combo), e.shape[0])
        if rate > best + 1e-12:
            best, arg = rate, combo
    return best


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.floats(0.0, 2.0), st.floats(0.0, 1.0), st.floats(0.0, 1.0),
       st.integers(0, 2**31 - 1))
def test_choice_is_the_exact_optimum(batch, depth, c_0, c_req, c_row, seed):
    gen = torch.Generator().manual_seed(seed)
    e = expected_committed(torch.rand(batch, depth, generator=gen))
    allowed = torch.rand(batch, depth + 1, generator=gen) < 0.7
    cost = StepCost(c_0 + 1e-3, c_req, c_row)
    k = choose_depths(e, cost, allowed)
    assert all(int(k[r]) == 0 or bool(allowed[r, int(k[r])]) for r in range(batch))
    rate = float(e.gather(1, k[:, None]).sum()) / cost(batch + int(k.sum()), batch)
    assert rate == pytest.approx(_brute_force(e, cost, allowed), rel=1e-9)


def test_cost_model_recovers_a_linear_cost_and_follows_a_change():
    model = StepCostModel(forget=0.9)
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        req = int(torch.randint(1, 17, (1,), generator=gen))
        rows = req + int(torch.randint(0, 9 * req, (1,), generator=gen))
        model.update(rows, req, 0.003 + 0.0002 * req + 0.0005 * rows)
    fit = model.fit()
    assert (fit.c_0, fit.c_req, fit.c_row) == pytest.approx((0.003, 0.0002, 0.0005), rel=1e-4)
    for _ in range(200):  # the machine got busier: rows now cost 4x
        req = int(torch.randint(1, 17, (1,), generator=gen))
        rows = req + int(torch.randint(0, 9 * req, (1,), generator=gen))
        model.update(rows, req, 0.003 + 0.0002 * req + 0.002 * rows)
    assert model.fit().c_row == pytest.approx(0.002, rel=1e-3)


def test_cost_model_keeps_coefficients_non_negative_and_rejects_bad_steps():
    model = StepCostModel()
    for rows, req in ((1, 1), (4, 1), (8, 2), (16, 4)):
        model.update(rows, req, 0.01 - 0.0001 * rows)  # a row that "saves" time is noise, not a price
    fit = model.fit()
    assert min(fit.c_0, fit.c_req, fit.c_row) >= 0.0
    with pytest.raises(ValueError, match="rows >= requests"):
        model.update(1, 2, 0.1)
    with pytest.raises(ValueError, match="no step measured"):
        StepCostModel().fit()


def test_acceptance_tracker_counts_reached_positions_and_shrinks_to_the_population():
    t = AcceptanceTracker(max_depth=4, prior=2.0, initial=0.5)
    torch.testing.assert_close(t.rates(["new"]), torch.full((1, 4), 0.5, dtype=torch.float64))
    t.record("a", 4, 2)  # positions 1, 2 accepted, 3 rejected, 4 never reached
    t.record("a", 4, 4)
    pop = t.population()
    torch.testing.assert_close(pop, torch.tensor([1.0, 1.0, 0.5, 1.0], dtype=torch.float64))
    rate_a = t.rates(["a"])[0]
    # position 3: reached twice, accepted once -> (1 + 2 * 0.5) / (2 + 2)
    assert rate_a[2].item() == pytest.approx(0.5)
    assert rate_a[3].item() == pytest.approx((1 + 2 * 1.0) / (1 + 2))
    t.forget("a")
    torch.testing.assert_close(t.rates(["a"])[0], pop)  # a returning id starts from the population
    with pytest.raises(ValueError, match="accepted"):
        t.record("b", 2, 3)
