"""Load-adaptive speculation depth (vllm_prove/core/adaptive/): golden cases, the exact optimum
against brute force, the online cost fit and the acceptance estimates; the controller's steps.
The guard's choice between plain decoding and speculation: tests/core/test_core_guard.py."""

from __future__ import annotations

import copy

import itertools
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_prove.core.adaptive import (
    SUMMARY_EVERY, AcceptanceTracker, DepthController, DraftKind, StepCost, StepCostModel, StepShape, choose_depths,
    expected_committed, solve, summary_delta)

PAR, SEQ = DraftKind.PARALLEL, DraftKind.SEQUENTIAL


def depths(*args, **kwargs) -> list[int]:
    return choose_depths(*args, **kwargs)[0].tolist()


def test_expected_committed_golden():
    e = expected_committed(torch.tensor([[0.5, 0.5, 1.0], [1.0, 1.0, 1.0], [0.0, 0.9, 0.9]]))
    torch.testing.assert_close(e, torch.tensor([[1.0, 1.5, 1.75, 2.0], [1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0]],
                                               dtype=torch.float64))


def test_free_rows_speculate_fully_and_dear_rows_not_at_all():
    e = expected_committed(torch.full((3, 8), 0.7))
    assert depths(e, StepCost(c_0=1.0, c_req=0.1, c_row=0.0)) == [8, 8, 8]
    assert choose_depths(e, StepCost(c_0=1.0, c_req=0.1, c_row=1e-9))[1] == 8
    # a position nobody accepts adds rows and no tokens: never worth it, even when rows are free
    flat = expected_committed(torch.tensor([[0.9, 0.9, 0.0, 0.0]]))
    k, d = choose_depths(flat, StepCost(c_0=1.0, c_req=0.1, c_row=1e-6))
    assert (k.tolist(), d) == ([2], 2)  # and nobody drafts deeper than anyone verifies
    assert choose_depths(e, StepCost(c_0=0.01, c_req=0.01, c_row=10.0))[1] == 0
    assert depths(e, StepCost(c_0=0.01, c_req=0.01, c_row=10.0)) == [0, 0, 0]


def test_a_dear_drafter_pass_turns_speculation_off_and_a_cheap_one_on():
    e = expected_committed(torch.full((4, 8), 0.6))
    cheap = StepCost(c_0=1.0, c_req=0.0, c_row=0.01, c_pass=0.1, c_draft_row=0.001)
    dear = StepCost(c_0=1.0, c_req=0.0, c_row=0.01, c_pass=5.0, c_draft_row=0.001)
    assert choose_depths(e, cheap, PAR)[1] > 0
    assert choose_depths(e, dear, PAR)[1] == 0 and depths(e, dear, PAR) == [0, 0, 0, 0]
    # a sequential drafter pays a pass per draft position: the same prices give a shallower depth
    mid = StepCost(c_0=1.0, c_req=0.0, c_row=0.01, c_pass=0.3, c_draft_row=0.001)
    assert choose_depths(e, mid, SEQ)[1] < choose_depths(e, mid, PAR)[1]


def test_requests_that_accept_more_speculate_deeper():
    accept = torch.tensor([[0.95] * 8, [0.2] * 8])
    k, d = choose_depths(expected_committed(accept), StepCost(c_0=1.0, c_req=0.05, c_row=0.08))
    assert k[0] > k[1] and d == k[0]


def test_gated_requests_take_a_full_window_or_none():
    e = expected_committed(torch.tensor([[0.9] * 8, [0.1] * 8]))
    allowed = torch.zeros(2, 9, dtype=torch.bool)
    allowed[:, 8] = True
    assert depths(e, StepCost(c_0=1.0, c_req=0.05, c_row=0.1), PAR, allowed) == [8, 0]


def _rate(e, combo, d, cost, kind):
    shape = StepShape.of(e.shape[0], sum(combo), d, kind, spec_requests=sum(1 for k in combo if k))
    return sum(float(e[r, k]) for r, k in enumerate(combo)) / cost(shape)


def _brute_force(e, cost, allowed, kind):
    best = -1.0
    options = [[k for k in range(e.shape[1]) if k == 0 or allowed[r, k]]
               for r in range(e.shape[0])]
    for d in range(e.shape[1]):
        for combo in itertools.product(*options):
            if max(combo) <= d:
                best = max(best, _rate(e, combo, d, cost, kind))
    return best


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.lists(st.floats(0.0, 1.0), min_size=7, max_size=7),
       st.sampled_from(list(DraftKind)), st.integers(0, 2**31 - 1))
def test_choice_is_the_exact_optimum(batch, depth, coefs, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    e = expected_committed(torch.rand(batch, depth, generator=gen))
    allowed = torch.rand(batch, depth + 1, generator=gen) < 0.7
    cost = StepCost(coefs[0] + 1e-3, *coefs[1:])
    k, d = choose_depths(e, cost, kind, allowed)
    assert all(int(k[r]) == 0 or bool(allowed[r, int(k[r])]) for r in range(batch))
    assert int(k.max()) <= d <= depth
    assert _rate(e, k.tolist(), d, cost, kind) == pytest.approx(_brute_force(e, cost, allowed, kind), rel=1e-9)


def _random_shape(gen, kind):
    req = int(torch.randint(1, 17, (1,), generator=gen))
    d = int(torch.randint(0, 9, (1,), generator=gen))
    spec_req = int(torch.randint(0, req + 1, (1,), generator=gen)) if d else 0
    return StepShape.of(req, int(torch.randint(0, d * spec_req + 1, (1,), generator=gen)) if spec_req else 0, d, kind,
                        extra_rows=int(torch.randint(0, 50, (1,), generator=gen)), spec_requests=spec_req)


@pytest.mark.parametrize("kind", list(DraftKind))
def test_cost_model_recovers_a_linear_cost_and_follows_a_change(kind):
    model = StepCostModel(forget=0.9)
    gen = torch.Generator().manual_seed(0)
    truth = StepCost(0.003, 0.0002, 0.0005, 0.002, 0.0001, 0.0003, 0.00015 if kind is PAR else 0.0)
    for _ in range(60):
        shape = _random_shape(gen, kind)
        model.update(shape, truth(shape))
    fit = model.fit()
    if kind is PAR:
        np.testing.assert_allclose(fit.coefficients(), truth.coefficients(), rtol=1e-4, atol=1e-9)
    else:  # a sequential drafter reads every request: c_draft_req is c_req's twin, only their sum is known
        np.testing.assert_allclose(fit.coefficients()[[0, 2, 3, 4, 5]], truth.coefficients()[[0, 2, 3, 4, 5]],
                                   rtol=1e-4, atol=1e-9)
        assert fit.c_req + fit.c_draft_req == pytest.approx(truth.c_req + truth.c_draft_req, rel=1e-4)
    busier = StepCost(0.003, 0.0002, 0.002, 0.002, 0.0001, 0.0003, 0.00015 if kind is PAR else 0.0)  # rows cost 4x
    for _ in range(200):
        shape = _random_shape(gen, kind)
        model.update(shape, busier(shape))
    assert model.fit().c_row == pytest.approx(0.002, rel=1e-3)


def test_cost_model_keeps_coefficients_non_negative_and_rejects_bad_steps():
    model = StepCostModel()
    for rows, req in ((1, 1), (4, 1), (8, 2), (16, 4)):
        # a row that "saves" time is noise, not a price
        model.update(StepShape(req, rows, 0, 1, rows, req), 0.01 - 0.0001 * rows)
    fit = model.fit()
    assert min(fit.coefficients().tolist()) >= 0.0
    with pytest.raises(ValueError, match="rows >= requests"):
        model.update(StepShape(2, 1, 0, 0, 0, 0), 0.1)
    with pytest.raises(ValueError, match="no step measured"):
        StepCostModel().fit()


def test_acceptance_tracker_counts_reached_positions_and_shrinks_to_the_population():
    t = AcceptanceTracker(max_depth=4, prior=2.0, initial=0.5)
    torch.testing.assert_close(t.rates(["new"]), torch.full((1, 4), 0.5, dtype=torch.float64))
    t.record("a", 4, 2)  # positions 1, 2 accepted, 3 rejected, 4 never reached
    t.record("a", 4, 4)
    pop = t.population()  # (accepted + 2 * previous position's estimate) / (reached + 2)
    p1 = (2 + 2 * 0.5) / 4
    p2 = (2 + 2 * p1) / 4
    p3 = (1 + 2 * p2) / 4
    p4 = (1 + 2 * p3) / 3
    torch.testing.assert_close(pop, torch.tensor([p1, p2, p3, p4], dtype=torch.float64))
    rate_a = t.rates(["a"])[0]
    # position 3: reached twice, accepted once -> (1 + 2 * pop_3) / (2 + 2)
    assert rate_a[2].item() == pytest.approx((1 + 2 * p3) / 4)
    assert rate_a[3].item() == pytest.approx((1 + 2 * p4) / (1 + 2))
    # a position never drafted inherits the one before it, not the 0.5 of `initial`
    good = AcceptanceTracker(max_depth=6, prior=2.0, initial=0.5)
    for _ in range(50):
        good.record("x", 2, 2)
    assert good.population()[5].item() > 0.9
    t.forget("a")
    torch.testing.assert_close(t.rates(["a"])[0], pop)  # a returning id starts from the population
    with pytest.raises(ValueError, match="accepted"):
        t.record("b", 2, 3)



def test_step_shapes_of_both_drafters():
    assert StepShape.of(4, 10, 0, PAR, spec_requests=3) == StepShape(4, 14, 3, 0, 0, 0)
    assert StepShape.of(4, 10, 8, PAR, spec_requests=3) == StepShape(4, 14, 3, 1, 32, 4)
    # vLLM's draft model re-reads the verified rows even when it drafts nothing
    assert StepShape.of(4, 10, 0, SEQ, spec_requests=2) == StepShape(4, 14, 2, 0, 0, 0)  # no draft pass
    assert StepShape.of(4, 10, 5, SEQ, spec_requests=2) == StepShape(4, 14, 2, 5, 14 + 16, 4)
    assert StepShape.of(1, 0, 2, PAR, extra_rows=30).rows == 31


def test_a_speculative_plan_never_plans_plain_decoding():
    """``min_draft_depth=1``: where plain decoding is the cheaper plan, the solver still gives the
    best plan that drafts (whether to speculate is the guard's question, not the solver's)."""
    dear = StepCost(c_0=0.01, c_req=0.0005, c_row=0.002, c_pass=0.004, c_draft_row=0.002)
    e = expected_committed(torch.full((32, 8), 0.6)).numpy()
    assert solve(e, dear).draft_depth == 0
    plan = solve(e, dear, min_draft_depth=1)
    assert plan.draft_depth >= 1 and plan.rate < solve(e, dear).rate
    rates = [solve(e, dear, min_draft_depth=1).rate] + [
        e[:, d].sum() / dear(StepShape.of(32, 32 * d, d, PAR, spec_requests=32)) for d in range(1, 9)]
    assert plan.rate >= max(rates[1:]) - 1e-9  # at least as good as any uniform depth


def _feed(ctrl, truth, accept, steps, requests, load=None):
    """Run the controller against a simulated engine: steps cost `truth`, each draft position is
    accepted with probability `accept` once the earlier ones were (seeded)."""
    rng = random.Random(0)
    held = {r: 0 for r in requests}
    for _ in range(steps):
        plan = ctrl.decide(requests, load=load)
        verify = {r: min(k, held[r]) for r, k in plan.depths.items()}
        committed = len(requests)
        for r, k in verify.items():
            if k:
                accepted = next((j for j in range(k) if rng.random() >= accept), k)
                ctrl.observe_verification(r, k, accepted)
                committed += accepted
        shape = StepShape.of(len(requests), sum(verify.values()), plan.draft_depth, ctrl.kind,
                             spec_requests=sum(1 for k in verify.values() if k))
        ctrl.observe_step(shape, truth(shape), committed, plan.load)
        held = {r: plan.draft_depth for r in requests}
    return ctrl


LIGHT = StepCost(c_0=0.01, c_req=0.0005, c_row=0.00005, c_pass=0.004, c_draft_row=0.00005)
DEAR = StepCost(c_0=0.01, c_req=0.0005, c_row=0.002, c_pass=0.004, c_draft_row=0.002)
MANY = [f"r{i}" for i in range(32)]


def test_controller_probes_then_follows_the_load():
    ctrl = _feed(DepthController(8, PAR), LIGHT, 0.8, 300, ["a"])
    assert ctrl.probe == [8, 8, 4, 1, 0]
    assert ctrl.model_log_ratio(1) > 0.3  # cheap rows: the model predicts speculation far ahead ...
    plans = [ctrl.decide(["a"]) for _ in range(16)]
    assert all(p.draft_depth >= 5 for p in plans if not p.explored)  # ... and it speculates deep
    assert ctrl.guard.summary()["1"]["arm"] == "speculative"
    # 32 requests where every row is dear: the model predicts plain decoding, the guard agrees
    ctrl = _feed(DepthController(8, PAR), DEAR, 0.8, 300, MANY)
    assert ctrl.model_log_ratio(32) < -0.3
    plans = [ctrl.decide(MANY) for _ in range(8)]
    s = ctrl.summary()
    assert s["realized"]["32"]["arm"] == "plain" and s["cost"]["c_row"] > 0.001
    assert sum(p.draft_depth == 0 for p in plans) >= 7  # (an exploration block may be due)
    # a multi-token query that costs per request turns speculation off even where rows are cheap
    spec_dear = StepCost(c_0=0.01, c_req=0.0005, c_row=0.00005, c_pass=0.004, c_draft_row=0.00005, c_spec_req=0.002,
                         c_draft_req=0.001)
    ctrl = _feed(DepthController(8, PAR), spec_dear, 0.8, 300, MANY)
    assert ctrl.summary()["realized"]["32"]["arm"] == "plain"


def test_the_probe_verifies_what_it_drafts_and_the_model_predicts_only_where_speculation_ran():
    """The probe's depths fall, so each drafting step's drafts are verified by the next (a plain
    step after the deepest one dropped them, and the fit saw one verification row in the whole
    probe). The model's prediction stays None at a load heavier than every one where a speculative
    step ran: after a warm-up at one request in flight, 16 in flight would be an extrapolation."""
    seen = []
    ctrl = DepthController(8, PAR)
    observe = ctrl.observe_step
    ctrl.observe_step = lambda shape, *a, **k: (seen.append(shape), observe(shape, *a, **k))[1]
    _feed(ctrl, LIGHT, 1.0, 40, ["a"])
    verified = [shape.rows - shape.requests for shape in seen[: len(ctrl.probe)]]
    assert verified == [0, 8, 4, 1, 0]  # (accept 1.0: every draft verified is held)
    assert ctrl.model_log_ratio(1) is not None and ctrl.model_log_ratio(2) is None
    assert ctrl.model_log_ratio(16) is None and ctrl.guard.state(16).prior is None
    shape = StepShape.of(16, 16 * 4, 4, PAR, spec_requests=16)  # one speculative step at 16 in flight
    ctrl.observe_step(shape, LIGHT(shape), 16 * 5, 16)
    assert ctrl.model_log_ratio(16) is not None and ctrl.model_log_ratio(9) is not None


def test_policies_speculate_plain_and_random():
    """``speculate``: the solver's plan every step, even where rows are dear (a test that needs
    speculation says so through this, not through timing luck); ``plain``: never drafts;
    ``random``: any depth, K_r <= D."""
    ctrl = _feed(DepthController(8, PAR, policy="speculate"), DEAR, 0.8, 100, MANY)
    assert "0" not in ctrl.summary()["draft_depths"] and ctrl.summary()["realized"] == {}
    assert all(ctrl.decide(MANY).draft_depth >= 1 for _ in range(20))
    rnd = DepthController(4, SEQ, policy="random", seed=3)
    plans = [rnd.decide(["a", "b", "c"]) for _ in range(200)]
    assert all(max(p.depths.values()) <= p.draft_depth for p in plans)
    assert {p.draft_depth for p in plans} == {0, 1, 2, 3, 4}
    gated = DepthController(7, PAR, allowed=(7,), policy="random", seed=1)
    assert {k for p in (gated.decide(["a"]) for _ in range(50)) for k in p.depths.values()} == {0, 7}
    with pytest.raises(ValueError, match="policy"):
        DepthController(4, PAR, policy="greedy")
    plain = DepthController(4, PAR, policy="plain")  # the diagnostic: no drafts, no probe
    plans = [plain.decide(["a", "b"]) for _ in range(20)]
    assert {p.draft_depth for p in plans} == {0} and {k for p in plans for k in p.depths.values()} == {0}
    assert plain.decide([], load=2).draft_depth == 0


def test_controller_explores_neighbouring_depths_on_schedule():
    ctrl = _feed(DepthController(4, PAR, explore_every=5), StepCost(0.01, 0.0, 0.0001, 0.001, 0.0001), 0.9, 200,
                 ["a", "b"])
    plans = [ctrl.decide(["a", "b"]) for _ in range(10)]
    assert ctrl.guard.speculates(2)
    explored = [p.explored for p in plans]
    assert explored == [s % 5 == 0 for s in range(200, 210)]
    assert all(p.draft_depth > 0 for p in plans)  # (never depth 0: that is the guard's arm)


def test_batched_records_equal_one_by_one_records():
    one, many = AcceptanceTracker(max_depth=5), AcceptanceTracker(max_depth=5)
    steps = [(["a", "b", "c"], [5, 3, 0], [2, 3, 0]), (["a", "c"], [4, 1], [4, 0])]
    for ids, drafted, accepted in steps:
        for r, n, a in zip(ids, drafted, accepted):
            one.record(r, n, a)
        many.record_many(ids, drafted, accepted)
    torch.testing.assert_close(one.rates(["a", "b", "c"]), many.rates(["a", "b", "c"]))
    torch.testing.assert_close(one.population(), many.population())
    assert many.verified_per_position()[:2] == [4, 3] and many.accepted_per_position()[0] == 3
    with pytest.raises(ValueError, match="accepted <= drafted"):
        many.record_many(["a"], [2], [3])


def test_summary_delta_is_a_runs_own_share_with_json_keys():
    ctrl = DepthController(4, PAR, policy="random", seed=0)
    for _ in range(5):
        ctrl.decide(["a", "b"])
    before = ctrl.summary()
    for _ in range(7):
        ctrl.decide(["a"])
    delta = summary_delta(before, ctrl.summary())
    assert delta["steps"] == 7 and sum(delta["depths"].values()) == 7 and sum(delta["draft_depths"].values()) == 7
    assert all(isinstance(k, str) for k in delta["depths"])
    total = sum(delta["depths"].values())
    assert delta["mean_depth"] == pytest.approx(round(sum(int(k) * v for k, v in delta["depths"].items()) / total, 3))
    assert delta["plain_share"] == pytest.approx(round(delta["depths"].get("0", 0) / total, 4))


def test_pinned_requests_keep_the_full_depth_under_any_policy():
    ctrl = _feed(DepthController(8, PAR), DEAR, 0.8, 300, MANY)
    assert not ctrl.guard.speculates(32)  # the load decodes plainly ...
    plan = ctrl.decide(MANY, pinned=frozenset({"r3", "gone"}))
    # ... but while a seeded sampler runs, the batch keeps the fixed depth's shape
    assert plan.draft_depth == 8 and set(plan.depths.values()) == {8} and "gone" not in plan.depths
    # a pinned request still in its prefill: no decoding request, the batch drafts the full depth
    assert ctrl.decide([], pinned=frozenset({"new"})).draft_depth == 8
    rnd = DepthController(4, PAR, policy="random", seed=0)
    assert all(rnd.decide(["a", "b"], pinned=frozenset({"a"})).depths == {"a": 4, "b": 4} for _ in range(50))


def test_the_probe_feeds_only_the_fit_and_a_late_observation_is_judged_by_its_own_decision():
    """The engine observes a step while the next one runs (``step=`` names its decision): the
    probe's steps, on time or late, never reach the guard; the steps after it do."""
    ctrl = DepthController(4, PAR)
    for _ in range(len(ctrl.probe)):
        ctrl.decide(["a"])
    ctrl.decide(["a"])
    ctrl.observe_step(StepShape.of(1, 4, 4, PAR, spec_requests=1), 0.004, 5, 1, len(ctrl.probe) - 1)  # late
    assert ctrl.costs.count == 1 and ctrl.guard.state(1).seconds == 0
    ctrl.observe_step(StepShape.of(1, 4, 4, PAR, spec_requests=1), 0.004, 5, 1, len(ctrl.probe))
    assert ctrl.costs.count == 2 and ctrl.guard.state(1).seconds == pytest.approx(0.004)


def test_prepare_makes_the_next_decisions_fit_and_solve_ahead_without_changing_it():
    """The engine calls ``prepare`` while its workers run a step: where the next decision is the
    solver's and a fit is due, the fit and the solve are made there, and the next ``decide`` makes
    neither and decides as it would have alone; where the load decodes plainly it does nothing."""
    cost = StepCost(c_0=0.004, c_req=0.0002, c_row=0.0002, c_pass=0.001, c_draft_row=0.0001)
    ctrl = _feed(DepthController(8, PAR), cost, 0.7, 200, ["a"])
    while ctrl.steps - ctrl._fit_step < ctrl.refit_every or ctrl.steps % ctrl.explore_every == 0 \
            or not ctrl.guard.speculates(1):
        _feed(ctrl, cost, 0.7, 1, ["a"])  # (to a step whose decision fits afresh, not an exploration)
    calls = []

    def counted(c):
        fit, plan = c.costs.fit, c._plan
        c.costs.fit = lambda: calls.append("fit") or fit()
        c._plan = lambda *a: calls.append("solve") or plan(*a)
        return c

    alone = counted(copy.deepcopy(ctrl))
    assert alone.decide(["a"]).draft_depth > 0 and calls == ["fit", "solve"]  # (a solver's decision)
    calls.clear()
    ahead = counted(copy.deepcopy(ctrl))
    ahead.prepare(["a"], 1)
    assert calls == ["fit", "solve"] and ahead._fit_step == ahead.steps
    calls.clear()
    plan, plan_alone = ahead.decide(["a"]), copy.deepcopy(ctrl).decide(["a"])
    assert calls == [] and (plan.depths, plan.draft_depth) == (plan_alone.depths, plan_alone.draft_depth)
    # prepared for "a"; "b" takes its place: the decision solves for itself, with the prepared fit
    other = counted(copy.deepcopy(ctrl))
    other.prepare(["a"], 1)
    calls.clear()
    assert other.decide(["b"]).depths.keys() == {"b"} and calls == ["solve"]
    # where the load decodes plainly, nothing is prepared
    plain = counted(_feed(DepthController(8, PAR), DEAR, 0.8, 300, MANY))
    calls.clear()
    plain.prepare(MANY, 32)
    assert not plain.guard.speculates(32) and calls == []


def test_steps_of_prompts_only_draft_for_the_load_they_admit():
    """A step that only admits prompts drafts what the next step at its load will verify: nothing
    where that load decodes plainly (the drafts would be dropped), the solver's depth where it
    speculates; it is judged at no less than the last decoding load (the next wave's first prompt
    can arrive alone), and names that load for its observation."""
    ctrl = _feed(DepthController(8, PAR), DEAR, 0.8, 300, MANY)
    _feed(ctrl, DEAR, 0.8, 200, ["a"])  # one request: rows are cheap enough alone
    assert not ctrl.guard.speculates(32) and ctrl.guard.speculates(1)
    assert ctrl.draft_depth_for(32, 8) == 0 and ctrl.draft_depth_for(1, 8) == 8
    alone = ctrl.decide([], load=1)
    assert (alone.draft_depth, alone.load) == (ctrl._fresh_draft_depth(1), 1)  # (the last decoding load was 1)
    ctrl.decide(MANY)
    wave = ctrl.decide([], load=1)
    assert (wave.draft_depth, wave.load) == (0, 32)  # judged at 32: plain there, no drafts
    assert ctrl.decide([], load=1).draft_depth == 0


def test_step_summary_keeps_counts_current_and_refreshes_estimates_every_few_steps():
    ctrl = _feed(DepthController(4, PAR), LIGHT, 0.8, 100, ["a"])
    first = ctrl.step_summary()
    assert first["steps"] == 100 and first["realized"]["1"]["arm"] == "speculative" and first["block_noise"] > 0
    _feed(ctrl, LIGHT, 0.8, SUMMARY_EVERY - 1, ["a"])
    later = ctrl.step_summary()
    assert later["steps"] == 100 + SUMMARY_EVERY - 1 and later["realized"] == first["realized"]
    _feed(ctrl, LIGHT, 0.8, 1, ["a"])
    assert ctrl.step_summary()["realized"] != first["realized"]
