"""Load-adaptive speculation depth (vllm_prove/core/adaptive.py): golden cases, the exact optimum
against brute force, the online cost fit and the acceptance estimates."""

from __future__ import annotations

import copy

import itertools
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_prove.core.adaptive import (CLOSE_STEPS, ENTER_MARGIN, MARGIN, PLAIN_REFIT_EVERY, PLAIN_SETTLE_STEPS, RETRY_LOSS_BUDGET, SUMMARY_EVERY, AcceptanceTracker, DepthController, DraftKind, StepCost, StepCostModel,
                                      StepShape, ThroughputGuard, choose_depths, expected_committed, summary_delta)

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


def _past_probe(ctrl, requests):
    """The controller after its start-up probe (whose steps the throughput guard does not count)."""
    for _ in range(len(ctrl.probe) + 1):
        ctrl.decide(requests)
    return ctrl


def _feed(ctrl, truth, accept, steps, requests):
    """Run the controller against a simulated engine: steps cost `truth`, each draft position is
    accepted with probability `accept` once the earlier ones were (seeded)."""
    rng = random.Random(0)
    held = {r: 0 for r in requests}
    for _ in range(steps):
        plan = ctrl.decide(requests)
        verify = {r: min(k, held[r]) for r, k in plan.depths.items()}
        committed = len(requests)
        for r, k in verify.items():
            if k:
                accepted = next((j for j in range(k) if rng.random() >= accept), k)
                ctrl.observe_verification(r, k, accepted)
                committed += accepted
        shape = StepShape.of(len(requests), sum(verify.values()), plan.draft_depth, ctrl.kind,
                             spec_requests=sum(1 for k in verify.values() if k))
        ctrl.observe_step(shape, truth(shape), committed)
        held = {r: plan.draft_depth for r in requests}
    return ctrl


def test_guard_learns_the_plain_rate_of_vllms_draft_model_too():
    """Mode `sd`: a plain step drafts no token and the guard counts it as plain (else the plain rate
    is never known and a plain block never ends); a step that only verifies belongs to the
    speculative regime (it commits what the step before drafted). A load's first speculative
    steps (new shapes: slow first passes) do not count."""
    ctrl = _past_probe(DepthController(5, SEQ), ["a"])
    for _ in range(4):
        ctrl.observe_step(StepShape.of(1, 0, 0, SEQ), 0.003, 1)  # plain: one token
    assert ctrl.guard.knows(1, speculative=False) and not ctrl.guard.knows(1, speculative=True)
    for _ in range(4):
        ctrl.observe_step(StepShape.of(1, 5, 0, SEQ, spec_requests=1), 0.040, 6)  # the load's first: not counted
    assert not ctrl.guard.knows(1, speculative=True)
    for _ in range(4):
        ctrl.observe_step(StepShape.of(1, 5, 0, SEQ, spec_requests=1), 0.004, 6)  # verifies, drafts nothing
    assert ctrl.guard.rate(1, speculative=True) == pytest.approx(6 / 0.004)
    assert ctrl.guard.rate(1, speculative=False) == pytest.approx(1 / 0.003)
    # one request, speculation much faster: after the probe, no plain steps (no block is worth it)
    cheap = StepCost(c_0=0.003, c_req=0.0, c_row=0.00002, c_pass=0.0005, c_draft_row=0.00002)
    ctrl = _feed(DepthController(5, SEQ), cheap, 0.9, 100, ["a"])
    plain = sum(ctrl.decide(["a"]).draft_depth == 0 for _ in range(200))
    assert plain == 0


def test_controller_probes_then_follows_the_load():
    light = StepCost(c_0=0.01, c_req=0.0005, c_row=0.00005, c_pass=0.004, c_draft_row=0.00005)
    ctrl = _feed(DepthController(8, PAR), light, 0.8, 81, ["a"])  # step 81 is no exploration step
    assert ctrl.probe[:2] == [8, 0] and ctrl.steps == 81
    assert ctrl.decide(["a"]).draft_depth >= 6  # one request, cheap rows: speculate deep
    # 32 requests where every row is dear: plain decoding
    dear = StepCost(c_0=0.01, c_req=0.0005, c_row=0.002, c_pass=0.004, c_draft_row=0.002)
    many = [f"r{i}" for i in range(32)]
    ctrl = _feed(DepthController(8, PAR), dear, 0.8, 81, many)
    plan = ctrl.decide(many)
    assert plan.draft_depth == 0 and set(plan.depths.values()) == {0} and not plan.explored
    s = ctrl.summary()
    assert s["steps"] == 82 and sum(s["draft_depths"].values()) == 82 and s["cost"]["c_row"] > 0.001
    # a multi-token query that costs per request turns speculation off even where rows are cheap
    spec_dear = StepCost(c_0=0.01, c_req=0.0005, c_row=0.00005, c_pass=0.004, c_draft_row=0.00005, c_spec_req=0.002,
                         c_draft_req=0.001)
    ctrl = _feed(DepthController(8, PAR), spec_dear, 0.8, 81, many)
    assert ctrl.decide(many).draft_depth == 0


def test_controller_explores_on_schedule_and_random_policy_keeps_k_within_d():
    ctrl = DepthController(4, PAR, explore_every=5)
    cost = StepCost(0.01, 0.0, 0.0001, 0.001, 0.0001)
    _feed(ctrl, cost, 0.9, 30, ["a", "b"])
    # the load's plain rate was measured in a block of plain steps after the start-up probe; now
    # every 5th step explores a neighbouring draft depth, never depth 0 (plain decoding is the
    # guard's to measure, in blocks)
    assert ctrl.guard.knows(2, speculative=False)
    plans = [ctrl.decide(["a", "b"]) for _ in range(10)]  # steps 30..39
    assert [p.explored for p in plans] == [s % 5 == 0 for s in range(30, 40)]
    assert all(p.draft_depth > 0 for p in plans)
    # a load whose plain rate the guard has not measured decodes plainly until it has: a block of
    # plain steps, the first PLAIN_SETTLE_STEPS of which (right after speculative ones) do not count
    four = ["a", "b", "c", "d"]
    for i in range(PLAIN_SETTLE_STEPS + ctrl.guard.min_steps):
        plan = ctrl.decide(four)
        assert plan.draft_depth == 0 and set(plan.depths.values()) == {0} and plan.explored
        ctrl.observe_step(StepShape.of(4, 0, 0, PAR), cost(StepShape.of(4, 0, 0, PAR)), 4)
        assert ctrl.guard.knows(4, speculative=False) == (i == PLAIN_SETTLE_STEPS + ctrl.guard.min_steps - 1)
    assert ctrl.decide(four).draft_depth > 0  # measured: the plan again
    rnd = DepthController(4, SEQ, policy="random", seed=3)
    plans = [rnd.decide(["a", "b", "c"]) for _ in range(200)]
    assert all(max(p.depths.values()) <= p.draft_depth for p in plans)
    assert {p.draft_depth for p in plans} == {0, 1, 2, 3, 4}
    gated = DepthController(7, PAR, allowed=(7,), policy="random", seed=1)
    assert {k for p in (gated.decide(["a"]) for _ in range(50)) for k in p.depths.values()} == {0, 7}
    with pytest.raises(ValueError, match="policy"):
        DepthController(4, PAR, policy="greedy")
    plain = DepthController(4, PAR, policy="plain")  # the diagnostic: no drafts, even in the probe
    plans = [plain.decide(["a", "b"]) for _ in range(20)]
    assert {p.draft_depth for p in plans} == {0} and {k for p in plans for k in p.depths.values()} == {0}


def test_batched_records_equal_one_by_one_records():
    one, many = AcceptanceTracker(max_depth=5), AcceptanceTracker(max_depth=5)
    steps = [(["a", "b", "c"], [5, 3, 0], [2, 3, 0]), (["a", "c"], [4, 1], [4, 0])]
    for ids, drafted, accepted in steps:
        for r, n, a in zip(ids, drafted, accepted):
            one.record(r, n, a)
        many.record_many(ids, drafted, accepted)
    torch.testing.assert_close(one.rates(["a", "b", "c"]), many.rates(["a", "b", "c"]))
    torch.testing.assert_close(one.population(), many.population())
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
    dear = StepCost(c_0=0.01, c_req=0.0005, c_row=0.002, c_pass=0.004, c_draft_row=0.002)
    many = [f"r{i}" for i in range(32)]
    ctrl = _feed(DepthController(8, PAR), dear, 0.8, 81, many)
    assert ctrl.decide(many).draft_depth == 0  # the load says plain decoding ...
    plan = ctrl.decide(many, pinned=frozenset({"r3", "gone"}))
    # ... but while a seeded sampler runs, the batch keeps the fixed depth's shape
    assert plan.draft_depth == 8 and set(plan.depths.values()) == {8} and "gone" not in plan.depths
    # a pinned request still in its prefill: no decoding request, the batch drafts the full depth
    assert ctrl.decide([], pinned=frozenset({"new"})).draft_depth == 8
    rnd = DepthController(4, PAR, policy="random", seed=0)
    assert all(rnd.decide(["a", "b"], pinned=frozenset({"a"})).depths == {"a": 4, "b": 4} for _ in range(50))


def test_throughput_guard_prefers_the_realized_faster_mode_per_load():
    guard = ThroughputGuard(min_steps=4, retry_every=8, margin=0.02)
    for _ in range(3):
        guard.observe(32, False, 32, 0.010)  # plain: 3200 tok/s at 32 running, 100 per request-second
        guard.observe(32, True, 36, 0.016)  # speculative: 2250 tok/s
    assert guard.rate(32, False) is None and not guard.plain_wins(32)  # too few steps to judge
    guard.observe(32, False, 32, 0.010)
    guard.observe(32, True, 36, 0.016)
    assert guard.rate(32, False) == pytest.approx(100) and guard.rate(32, True) == pytest.approx(2250 / 32)
    # plain until the plain steps have run 19 times what min_steps speculative steps cost (1.216 s),
    # then a retry: speculation's rate is forgotten, and speculation runs until min_steps steps
    # have measured it again
    plain_steps = 0
    while guard.plain_wins(32):
        guard.observe(32, False, 32, 0.010)
        plain_steps += 1
    assert plain_steps == 121 and not guard.knows(32, speculative=True)
    for _ in range(3):
        guard.observe(32, True, 36, 0.016)
        assert not guard.plain_wins(32)  # still measuring
    guard.observe(32, True, 36, 0.016)
    assert guard.plain_wins(32)  # plain is still ahead: plain again
    assert guard.summary()["32"] == {"plain": {"tok_per_req_s": 100.0, "steps": 4 + 121},
                                     "speculative": {"tok_per_req_s": 70.3, "steps": 4}, "retries": 1, "retry_ms": 64.0}
    assert guard.bucket(17) == guard.bucket(32) != guard.bucket(33) and guard.bucket(16) != guard.bucket(17)  # 9-16, 17-32, ...
    assert not guard.plain_wins(1)  # another load: nothing measured there
    # the next retry waits for 29.7 x the last one's 64 ms of plain steps: it found speculation
    # 29.7% short of plain decoding (not a close call: its 4 steps decided it), and retries give up at most 1% of the throughput (a 5% share
    # of the time alone would have it wait 19 x)
    guard.observe(32, False, 32, 0.010)
    plain_steps = 1
    while guard.plain_wins(32):
        guard.observe(32, False, 32, 0.010)
        plain_steps += 1
    assert plain_steps == 190  # 1.90 s >= 29.7 x 64 ms: the second retry
    for _ in range(4):  # this retry finds speculation faster (80 tokens per step)
        guard.observe(32, True, 80, 0.016)
    assert not guard.plain_wins(32) and not guard.plain_wins(32)  # speculation stays on
    assert guard.summary()["32"]["speculative"] == {"tok_per_req_s": 156.2, "steps": 4}


def _retry_cycles(spec_seconds: float, loss_budget: float, steps: int = 2000) -> tuple[list[int], float]:
    """A guard at 8 in flight where plain steps take 10 ms and speculative ones `spec_seconds`
    (committing as much: slower either way), run for `steps` decisions: the steps where retries
    start, and the share of the time retries took over whole cycles after the first retry."""
    guard = ThroughputGuard(min_steps=4, retry_loss_budget=loss_budget)
    for _ in range(4):
        guard.observe(8, False, 8, 0.010)
        guard.observe(8, True, 8, spec_seconds)
    decisions = []
    for _ in range(steps):
        plain = guard.plain_wins(8)
        decisions.append(plain)
        guard.observe(8, not plain, 8, 0.010 if plain else spec_seconds)
    starts = [i for i, (a, b) in enumerate(zip([True] + decisions, decisions)) if a and not b]
    steady = decisions[starts[1]:starts[-1]]  # whole cycles after the first retry
    spec_time = spec_seconds * steady.count(False)
    return starts, spec_time / (spec_time + 0.010 * steady.count(True))


def test_guard_retries_take_a_bounded_share_of_the_plain_regimes_time():
    """A retry of 4 speculative steps waits for 19 times its time in plain steps, so retries take
    5% of the time: where a speculative step costs four plain ones (a high load) one retry comes
    every 316 steps. Where it costs about one plain step the two rates are close (91 against 100
    per request-second), so each retry measures CLOSE_STEPS steps and the next waits for 19 times
    that: one every 701 steps, again 5% of the time. The first retry waits as if for 4 steps.
    (The throughput budget, next test, is left out here: `retry_loss_budget=0.9`.)"""
    dear, dear_share = _retry_cycles(0.041, 0.9)
    assert {b - a for a, b in zip(dear, dear[1:])} == {4 + 312} and 0.045 < dear_share <= 0.05  # 19 x 0.164 s
    cheap, cheap_share = _retry_cycles(0.011, 0.9)
    assert {b - a for a, b in zip(cheap, cheap[1:])} == {CLOSE_STEPS + 669} and 0.045 < cheap_share <= 0.05
    # the first retry waits as long: for 19 times what `min_steps` speculative steps have cost (the 4
    # plain steps observed before the loop count), not for `retry_every` decisions only
    assert (dear[0], cheap[0]) == (312 - 4, 84 - 4)
    guard = ThroughputGuard(min_steps=4)  # speculative steps far cheaper than plain ones: retry_every decides
    for _ in range(8):
        guard.observe(8, False, 8, 0.010)
        guard.observe(8, True, 0, 0.001)
    assert [guard.plain_wins(8) for _ in range(33)] == [True] * 32 + [False]
    with pytest.raises(ValueError, match=r"retry_budget must be in \(0, 1\), got 1.0"):
        ThroughputGuard(retry_budget=1.0)
    with pytest.raises(ValueError, match=r"retry_loss_budget must be in \(0, 1\), got 0"):
        ThroughputGuard(retry_loss_budget=0)


def test_guard_retries_give_up_a_bounded_share_of_the_plain_regimes_throughput():
    """Where the last retry found speculation far behind (a speculative step of 41 ms committing
    what a 10 ms plain one does: 24.4 against 100 per request-second, 75.6% short), a retry every
    19 of its lengths would give up 0.05 x 75.6% = 3.8% of the throughput; the next one waits
    until retries give up at most RETRY_LOSS_BUDGET (1%): 75.6 x its 164 ms. Where speculation is
    close (91 against 100, 9% short) the time budget is the stricter one and decides alone."""
    dear, dear_share = _retry_cycles(0.041, RETRY_LOSS_BUDGET, steps=5000)
    assert dear[0] == 312 - 4  # (the first retry: no shortfall measured yet, the time budget)
    assert {b - a for a, b in zip(dear[1:], dear[2:])} == {4 + 1241}  # 75.6 x 0.164 s = 12.4 s of 10 ms steps
    assert dear_share * 0.756 <= RETRY_LOSS_BUDGET < 0.045 * 0.756
    cheap, _ = _retry_cycles(0.011, RETRY_LOSS_BUDGET)
    assert {b - a for a, b in zip(cheap, cheap[1:])} == {CLOSE_STEPS + 669}  # as with the time budget alone


def test_guard_skips_the_start_up_probe_and_the_switches_between_regimes():
    """The probe's steps (every depth in turn, each shape's first passes: slow on a CPU), the step
    that switches from plain to speculative (it drafts; nothing was drafted for it to verify) and
    the first PLAIN_SETTLE_STEPS plain steps after speculative ones (dearer than the next ones) are no regime's
    steady cost; a step that only drafts while speculating (a prompt admitted alone) is part of
    the speculative regime."""
    ctrl = DepthController(4, PAR)
    for _ in range(len(ctrl.probe)):
        ctrl.decide(["a"])
        ctrl.observe_step(StepShape.of(1, 4, 4, PAR, spec_requests=1), 0.05, 1)
    assert ctrl.guard.summary() == {}
    ctrl.decide(["a"])
    for _ in range(PLAIN_SETTLE_STEPS):  # plain, right after speculative steps: settling
        ctrl.observe_step(StepShape.of(1, 0, 0, PAR), 0.005, 1)
    assert ctrl.guard.summary() == {}
    ctrl.observe_step(StepShape.of(1, 0, 0, PAR), 0.004, 1)  # plain, settled
    ctrl.observe_step(StepShape.of(1, 0, 4, PAR), 0.006, 1)  # the switch into speculation
    assert ctrl.guard.summary() == {"1": {"plain": {"tok_per_req_s": 250.0, "steps": 1}}}
    ctrl.observe_step(StepShape.of(1, 4, 4, PAR, spec_requests=1), 0.008, 4)  # verify and draft
    ctrl.observe_step(StepShape.of(1, 0, 4, PAR), 0.005, 1)  # drafts only, while speculating
    assert ctrl.guard.summary()["1"]["speculative"] == {"tok_per_req_s": round(4.8 / 0.0126, 1), "steps": 2}


def test_a_step_observed_after_the_next_decision_is_judged_by_its_own_decision():
    """The engine observes a step while the next one runs, after deciding it (``step=`` names the
    step's own decision): the probe's last step is still the probe's, not counted; the first step
    after the probe is."""
    for late in (False, True):
        ctrl = DepthController(4, PAR)
        pending = None
        for _ in range(len(ctrl.probe)):
            ctrl.decide(["a"])
            if late and pending is not None:
                ctrl.observe_step(*pending)
            # (speculative steps: the probe ends with them, and a plain step right after them settles)
            pending = (StepShape.of(1, 4, 4, PAR, spec_requests=1), 0.05, 1, None, ctrl.steps - 1)
            if not late:
                ctrl.observe_step(*pending)
        assert ctrl.guard.summary() == {}  # (the probe's steps)
        ctrl.decide(["a"])
        if late:
            ctrl.observe_step(*pending)
        ctrl.observe_step(StepShape.of(1, 4, 4, PAR, spec_requests=1), 0.004, 1, None, ctrl.steps - 1)
        assert ctrl.guard.summary() == {"1": {"speculative": {"tok_per_req_s": 250.0, "steps": 1}}}
    # a probe step observed late is the probe's (without `step=` it would count as the step after it)
    ctrl = DepthController(4, PAR)
    for _ in range(len(ctrl.probe)):
        ctrl.decide(["a"])
    ctrl.observe_step(StepShape.of(1, 0, 0, PAR), 0.05, 1)  # a probe step, on time
    ctrl.decide(["a"])
    ctrl.observe_step(StepShape.of(1, 0, 0, PAR), 0.004, 1, None, len(ctrl.probe) - 1)  # the probe's last, late
    assert ctrl.guard.summary() == {}
    ctrl.observe_step(StepShape.of(1, 0, 0, PAR), 0.004, 1, None, len(ctrl.probe))
    assert ctrl.guard.summary() == {"1": {"plain": {"tok_per_req_s": 250.0, "steps": 1}}}


def test_prepare_makes_the_next_decisions_fit_and_solve_ahead_without_changing_it():
    """The engine calls ``prepare`` while its workers run a step: where the next decision is the
    solver's and a fit is due, the fit and the solve are made there, and the next ``decide`` makes
    neither and decides as it would have alone; for other requests than prepared it solves for
    itself; where the guard decodes plainly prepare does nothing."""
    cost = StepCost(c_0=0.004, c_req=0.0002, c_row=0.0002, c_pass=0.001, c_draft_row=0.0001)
    ctrl = _feed(DepthController(8, PAR), cost, 0.7, 60, ["a"])
    while (ctrl.steps - ctrl._fit_step < ctrl.refit_every
           or ctrl.steps % (ctrl.explore_every * (1 if ctrl._last_draft_depth else 4)) == 0):
        _feed(ctrl, cost, 0.7, 1, ["a"])  # (to a step whose decision fits afresh, not an exploration)
    calls = []

    def counted(c):
        fit, solve = c.costs.fit, c._solve
        c.costs.fit = lambda: calls.append("fit") or fit()
        c._solve = lambda *a: calls.append("solve") or solve(*a)
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
    # prepared for "a"; "a" finishes and "b" takes its place: the decision solves for itself, with
    # the prepared fit
    other = counted(copy.deepcopy(ctrl))
    other.prepare(["a"], 1)
    calls.clear()
    assert other.decide(["b"]).depths.keys() == {"b"} and calls == ["solve"]
    # where the guard decodes plainly, nothing is prepared
    plain = counted(copy.deepcopy(ctrl))
    for _ in range(8):
        plain.guard.observe(1, False, 1, 0.001)  # plain 1000 per request-second
        plain.guard.observe(1, True, 2, 0.010)  # speculative 200
    calls.clear()
    plain.prepare(["a"], 1)
    assert plain.guard.prefers_plain(1) and calls == []


def test_a_new_wave_of_prompts_drafts_nothing_where_plain_decoding_wins():
    """A step that only prefills (16 prompts admitted together) drafts for the step after it; where
    plain decoding wins at 16 running, that step would drop the drafts, so it drafts none, while the
    depth in force (from a few requests finishing the last wave, which speculate) stays elsewhere."""
    ctrl, rnd = DepthController(8, PAR), DepthController(8, PAR, policy="random")
    for guard in (ctrl.guard, rnd.guard):
        for _ in range(8):
            guard.observe(16, False, 16, 0.004)  # 16 running: plain 250 per request-second
            guard.observe(16, True, 32, 0.020)  # speculative 100
            guard.observe(2, False, 2, 0.004)  # 2 running: speculation wins
            guard.observe(2, True, 6, 0.005)
    assert ctrl.draft_depth_for(16, 8) == 0 and ctrl.draft_depth_for(2, 8) == 8
    assert ctrl.draft_depth_for(1, 5) == 5  # a load not measured yet: the depth in force
    assert rnd.draft_depth_for(16, 8) == 8  # the random schedules of the exactness tests draw on


def test_a_step_of_prompts_only_is_judged_at_the_last_decoding_load():
    """Between two waves the next wave's first prompt can arrive alone: a step that only admits it
    is judged at the load the engine was decoding at (where plain decoding wins: no drafts, which
    the wave's next step would drop), not at 1 (where speculation wins); the decision names the
    load its step's observation feeds."""
    ctrl = DepthController(8, PAR, explore_every=1000)
    cost = StepCost(0.01, 0.0, 0.0001, 0.001, 0.0001)
    many = [f"r{i}" for i in range(16)]
    _feed(ctrl, cost, 0.9, 30, many)
    for _ in range(8):
        ctrl.guard.observe(16, False, 16, 0.004)  # 16 running: plain 250 per request-second
        ctrl.guard.observe(16, True, 32, 0.020)  # speculative 100
        ctrl.guard.observe(1, False, 1, 0.004)  # 1 running: speculation wins
        ctrl.guard.observe(1, True, 3, 0.005)
    assert ctrl.decide(many[:15], load=15).draft_depth == 0
    alone = ctrl.decide([], load=1)
    assert (alone.draft_depth, alone.load) == (0, 15)
    fresh = DepthController(8, PAR, explore_every=1000)  # (never decoded: judged at its own load)
    _feed(fresh, cost, 0.9, 30, ["a"])
    assert fresh.decide(["a"], load=1).load == 1 and fresh.decide([], load=1).draft_depth > 0
    assert ctrl.decide(["a"], load=1).load == 1  # a decoding step: its own load


def test_a_retry_judges_speculation_by_its_own_steps_not_a_stale_estimate():
    """Speculation looked slow once (a few unlucky steps, the first passes at new shapes); a retry
    forgets that and measures it again, so a load that now speculates faster does so from the
    first retry on, not after old steps have decayed away over many retries."""
    guard = ThroughputGuard(retry_every=8, retry_budget=0.5)  # (a retry as soon as retry_every allows)
    for _ in range(30):
        guard.observe(1, False, 1, 0.004)  # plain: 250 tok/s
        guard.observe(1, True, 1, 0.008)  # speculation once: 125 tok/s
    assert all(guard.plain_wins(1) for _ in range(8))
    assert not guard.plain_wins(1)  # the retry
    for _ in range(4):
        guard.observe(1, True, 3, 0.006)  # speculation now: 500 tok/s
    assert not any(guard.plain_wins(1) for _ in range(50))
    assert guard.rate(1, speculative=True) == pytest.approx(500)


def test_guard_rates_are_per_request_so_loads_in_one_bucket_compare_fairly():
    """Buckets hold loads up to 2x apart: plain steps seen at 9 running requests and speculative
    ones at 15 compare per request, not by the batch's total (which favours the bigger load)."""
    guard = ThroughputGuard(min_steps=1)
    guard.observe(9, False, 9, 0.008)  # plain at 9 running: 1125 tok/s, 125 per request-second
    guard.observe(15, True, 30, 0.020)  # speculative at 15: 1500 tok/s, but 100 per request-second
    assert guard.bucket(9) == guard.bucket(15) and guard.plain_faster(12)


def _regimes_with_prompts(guard, spec_row_seconds: float, spec_decode_seconds: float = 0.020) -> None:
    """16 in flight, 48 tokens a request, 100 prompt rows each. Plain decoding: 8 ms steps of 16
    tokens, and every 48 steps a finished wave's 16 prompts admitted together, 40 ms more
    (0.025 ms a row). Speculation: steps of 48 tokens, so a request finishes every step and its
    successors' prompt rows ride along at `spec_row_seconds` a row, two prompts every other step."""
    for _ in range(4):  # (steady steps first: a regime's steady step time is what its prompt rows are beyond)
        guard.observe(16, False, 16, 0.008)
        guard.observe(16, True, 48, spec_decode_seconds)
    for _ in range(6):
        for i in range(48):
            rows = 1600 if i == 0 else 0
            guard.observe(16, False, 16, 0.008 + rows * 0.000025, prefill_rows=rows)
        for _ in range(8):
            guard.observe(16, True, 48, spec_decode_seconds + 200 * spec_row_seconds, prefill_rows=200)
            guard.observe(16, True, 48, spec_decode_seconds)


def test_guard_prices_prompt_rows_per_regime_over_the_long_run():
    """Which steps carry prompt rows is partly chance (a plain regime admits a finished wave's
    prompts together; speculating requests finish out of step and are replaced one by one, each
    prompt in a step that carries the whole batch's drafts): a regime's rate is its decoding (a
    step with prompt rows decodes in the regime's steady step time) plus, for every token, the
    prompt rows the traffic brings with it (here 100 per 48 tokens) at the regime's own long-run
    price of a row. Charged as they come, the plain rate would swing with each wave; charged to
    speculation alone, speculation's lead in the second case below would read 7% (133 against
    plain decoding's 125 tokens per request-second), not the 18% it realizes."""
    rows_per_token = 100 / 48
    plain = 1 / (0.008 + rows_per_token * 0.000025 * 16)  # tokens per request-second
    guard = ThroughputGuard()
    _regimes_with_prompts(guard, spec_row_seconds=0.000150)  # a prompt row costs speculation 6x
    assert guard.rate(16, speculative=False) == pytest.approx(plain, rel=0.03)
    spec = 1 / (0.020 * 16 / 48 + rows_per_token * 0.000150 * 16)
    assert guard.rate(16, speculative=True) == pytest.approx(spec, rel=0.03) and spec < 0.9 * plain
    assert guard.plain_faster(16)  # (speculation's decoding alone, 150 per request-second, is faster)
    guard = ThroughputGuard()
    _regimes_with_prompts(guard, spec_row_seconds=0.000025)  # the same price: speculation ahead by a sixth
    spec = 1 / (0.020 * 16 / 48 + rows_per_token * 0.000025 * 16)
    assert guard.rate(16, speculative=True) == pytest.approx(spec, rel=0.03) and spec > 1.15 * plain
    assert guard.speculation_faster(16)
    # a step that only admits prompts (nothing decoded) is all price; before a regime has a
    # steady step, a step's prompt rows cost what the caller says (the cost fit's price)
    guard = ThroughputGuard()
    guard.observe(4, False, 0, 0.050, prefill_rows=400)
    for _ in range(4):
        guard.observe(4, False, 4, 0.030, prefill_rows=100, prefill_seconds=0.020)
    row = (0.050 + 4 * 0.020) / 800  # a prompt row's price: 0.16 ms
    assert guard.rate(4, speculative=False) == pytest.approx(1 / (0.010 + 800 / 16 * row * 4), rel=0.05)


def test_controller_decodes_plainly_where_the_realized_rate_says_so():
    """The cost fit believes speculation pays (a step costs what the linear model says), but the
    engine realizes fewer tokens per second on speculative steps than on plain ones: the guard
    turns the load plain, retrying speculation now and then."""
    ctrl = DepthController(4, PAR, explore_every=1000)
    cost = StepCost(0.01, 0.0, 0.0001, 0.001, 0.0001)
    _feed(ctrl, cost, 0.9, 30, ["a", "b"])
    assert ctrl.decide(["a", "b"]).draft_depth > 0
    for _ in range(40):  # (the simulated steps before fade from the estimates)
        ctrl.guard.observe(2, False, 2, 0.001)  # 2000 tok/s realized plain
        ctrl.guard.observe(2, True, 6, 0.010)  # 600 tok/s realized speculative
    ctrl.guard.retry_budget = 0.5  # a retry once plain steps have taken as long as 4 speculative ones
    plans = []
    for _ in range(33):
        plans.append(ctrl.decide(["a", "b"]))
        ctrl.guard.observe(2, False, 2, 0.002)
    assert all(p.draft_depth == 0 and set(p.depths.values()) == {0} for p in plans[:32])
    assert plans[32].draft_depth > 0  # a retry: speculation measured again


def test_step_summary_keeps_counts_current_and_refreshes_estimates_every_few_steps():
    """The summary every SchedulerOutput carries: decision counts exact at every step (a run's
    share is a difference of two of them), the estimates as of at most SUMMARY_EVERY steps ago."""
    ctrl = _feed(DepthController(4, PAR), StepCost(0.01, 0.0, 0.0001, 0.001, 0.0001), 0.9, 40, ["a", "b"])
    for _ in range(PLAIN_SETTLE_STEPS):  # (plain steps right after speculative ones: not counted)
        ctrl.observe_step(StepShape.of(2, 0, 0, PAR), 0.002, 2)
    first = ctrl.step_summary()
    assert first == ctrl.summary(refit=False)
    for step in range(1, 2 * SUMMARY_EVERY + 1):
        ctrl.decide(["a", "b"])
        ctrl.observe_step(StepShape.of(2, 0, 0, PAR), 0.002 * step, 2)  # the realized plain rate moves
        s = ctrl.step_summary()
        full = ctrl.summary(refit=False)
        assert {k: s[k] for k in ("policy", "steps", "depths", "draft_depths")} == \
               {k: full[k] for k in ("policy", "steps", "depths", "draft_depths")}
        refreshed = step % SUMMARY_EVERY == 0
        assert (s["realized"] == full["realized"]) == refreshed
        if not refreshed:
            assert s["realized"] == ctrl.step_summary()["realized"]  # the cached estimates


def test_a_retry_that_finds_the_two_rates_close_measures_on():
    """A retry that finds speculation far behind plain decoding ends once `min_steps` steps have
    measured it; one that finds the two within CLOSE_WITHIN goes on to CLOSE_STEPS steps, so a
    few slow steps do not decide a close call: here speculation reads 9% behind over its first
    8 steps and 25% ahead over the rest, and the retry ends speculating (a lead beyond
    ENTER_MARGIN)."""
    def retry(seconds):  # seconds of the retry's speculative steps, one after another
        guard = ThroughputGuard(min_steps=4, retry_budget=0.5)
        for _ in range(8):
            guard.observe(8, False, 8, 0.010)  # plain: 100 per request-second
            guard.observe(8, True, 8, 0.020)  # speculation: 50
        while guard.plain_wins(8):
            guard.observe(8, False, 8, 0.010)
        steps = 0
        while guard.retrying(8):
            guard.observe(8, True, 8, seconds(steps))
            steps += 1
            guard.plain_wins(8)  # (the next decision: the retry ends here once measured)
        return guard, steps
    guard, steps = retry(lambda i: 0.020)  # 50 per request-second: clearly behind
    assert steps == 4 and guard.prefers_plain(8)
    guard, steps = retry(lambda i: 0.011 if i < 8 else 0.008)  # 91, then 125
    assert steps == CLOSE_STEPS and not guard.prefers_plain(8)
    assert guard.rate(8, speculative=True) > 106


def test_a_plain_block_that_finds_the_two_rates_close_measures_on():
    """The same for a block measuring plain decoding afresh while speculating: a clear call ends
    after `min_steps` plain steps, a close one after CLOSE_STEPS."""
    def block(plain_seconds):
        guard = ThroughputGuard(min_steps=4, retry_budget=0.5)
        for _ in range(CLOSE_STEPS):  # (measured as long as a close call takes)
            guard.observe(8, False, 8, 0.012)  # plain: 83 per request-second
            guard.observe(8, True, 8, 0.010)  # speculation: 100, ahead by more than ENTER_MARGIN (less than REFRESH_WITHIN)
        assert not guard.prefers_plain(8)
        for _ in range(10_000):
            if guard.plain_block(8):
                break
            guard.observe(8, True, 8, 0.010)
        else:
            raise AssertionError("no plain block began")
        steps = 0
        while guard.plain_block(8):
            guard.observe(8, False, 8, plain_seconds)
            steps += 1
        return guard, steps
    guard, steps = block(0.012)  # 83 again: a close call
    assert steps == CLOSE_STEPS and not guard.prefers_plain(8)
    guard, steps = block(0.020)  # 50: clearly behind
    assert steps == 4 and not guard.prefers_plain(8)


def test_a_first_plain_reading_that_speculation_comes_close_to_is_measured_on():
    """A load's first plain block ends after `min_steps` steps (speculation, measured next, has no
    rate to compare with yet). Where speculation then comes within CLOSE_WITHIN of that reading,
    the reading is a close call decided on too few steps: the next decision goes on measuring
    plain decoding (its steps so far kept) until CLOSE_STEPS are counted. Here the first 4 plain
    steps ran slow (80 per request-second against a steady 100; the bench's `sd` engine once read
    77.8 at 32 in flight where a longer run read 87.4, and speculated at 0.88x AR on it): the
    load ends plain. Where speculation is far ahead of the first reading, it is not measured on."""
    def run(spec_committed):
        guard = ThroughputGuard(min_steps=4)
        blocked = 0
        while guard.plain_block(32):  # the load's first block: plain decoding unknown
            guard.observe(32, False, 32, 0.0125)  # 80 per request-second
            blocked += 1
        assert blocked == 4
        guard.measure_speculation(32)
        spec = 0
        while guard.retrying(32):
            guard.observe(32, True, spec_committed, 0.0125)
            spec += 1
            guard.plain_wins(32)  # (the next decision: the measurement ends here once settled)
        extended = 0
        while guard.plain_block(32):
            guard.observe(32, False, 32, 0.010)  # plain decoding's steady 100
            extended += 1
        return guard, spec, extended
    guard, spec, extended = run(38)  # speculation: 95, within 25% of the first reading
    assert spec == CLOSE_STEPS and extended == CLOSE_STEPS - 4  # (the 4 slow steps are kept)
    assert guard.rate(32, speculative=False) > 97 and guard.prefers_plain(32) and guard.plain_wins(32)
    guard, spec, extended = run(50)  # speculation: 125, far ahead of 80: a clear call
    assert spec == 4 and extended == 0 and not guard.prefers_plain(32)
    assert guard.rate(32, speculative=False) == pytest.approx(80)


def test_a_retry_speculates_where_the_fit_says_plain_and_ends_once_measured():
    """At a high load the cost fit rightly says plain decoding wins, so the solver decides depth 0;
    a retry must still speculate (every request verifies a draft), or it never measures
    speculation and never ends, and the solver's occasional drafting steps run unchecked. It ends
    after the switch step and `min_steps` measured steps, and the plain regime resumes."""
    dear = StepCost(c_0=0.01, c_req=0.0005, c_row=0.002, c_pass=0.004, c_draft_row=0.002)
    many = [f"r{i}" for i in range(32)]
    ctrl = _feed(DepthController(8, PAR, explore_every=1000), dear, 0.8, 81, many)
    assert ctrl.decide(many).draft_depth == 0  # the fit: plain
    for _ in range(8):
        ctrl.guard.observe(32, True, 48, 0.400)  # speculation realized: 3.75 per request-second
    assert ctrl.guard.plain_faster(32)  # (the plain steps fed: 11-16 per request-second)
    # a retry once the plain steps have taken as long as the last measurement of speculation
    ctrl.guard.retry_budget, ctrl.guard.retry_loss_budget = 0.5, 0.99
    plans = []
    for _ in range(200):
        plans.append(ctrl.decide(many))
        if ctrl.guard.retrying(32):
            break
        ctrl.observe_step(StepShape.of(32, 0, 0, PAR), 0.090, 32)
    assert ctrl.guard.retrying(32) and all(p.draft_depth == 0 for p in plans[:-1])
    retry = [plans[-1]]
    ctrl.observe_step(StepShape.of(32, 0, retry[0].draft_depth, PAR), 0.300, 32)  # the switch: drafts only
    for _ in range(4):
        plan = ctrl.decide(many)
        retry.append(plan)
        ctrl.observe_step(StepShape.of(32, sum(plan.depths.values()), plan.draft_depth, PAR, spec_requests=32),
                          0.400, 48)
    # (the fit says plain decoding wins: the retry measures the full depth, not the fit's depths)
    assert all(p.draft_depth == 8 and set(p.depths.values()) == {8} for p in retry)
    assert ctrl.decide(many).draft_depth == 0 and not ctrl.guard.retrying(32)  # measured: plain again
    assert ctrl.guard.summary()["32"]["retries"] == 1


def test_decisions_are_judged_and_observed_at_the_load_the_step_runs():
    """At a steady 9 in flight a finished request's successor is admitted in the next step, which
    decodes 8: judged at 8 (bucket 5-8, where speculation won) against 9 (bucket 9-16, where
    plain decoding wins), every finish would switch regimes for a step. Judged at the step's load
    (9), it stays plain; observed with that load, the step feeds the load's bucket."""
    ctrl = _feed(DepthController(8, PAR, explore_every=1000), StepCost(0.01, 0.0, 0.0001, 0.001, 0.0001), 0.9, 30,
                 ["a"])  # the cost fit: speculate
    for _ in range(8):
        ctrl.guard.observe(9, False, 9, 0.008)  # 9 running: plain 125 per request-second
        ctrl.guard.observe(9, True, 13.5, 0.024)  # speculative 62.5
        ctrl.guard.observe(8, False, 8, 0.008)  # 5-8 running: speculation wins
        ctrl.guard.observe(8, True, 24, 0.012)
    eight = [f"r{i}" for i in range(8)]
    assert ctrl.guard.plain_faster(9) and not ctrl.guard.plain_faster(8)
    assert not ctrl.guard.plain_wins(8)  # (no decision yet: the guard alone)
    plan = ctrl.decide(eight, load=9)
    assert plan.draft_depth == 0 and set(plan.depths.values()) == {0}
    assert ctrl.decide(eight).draft_depth > 0  # judged at 8: speculate
    for _ in range(PLAIN_SETTLE_STEPS):  # (plain steps right after speculative ones: settling)
        ctrl.observe_step(StepShape.of(8, 0, 0, PAR), 0.008, 8, load=9)
    steps = ctrl.guard.summary()["16"]["plain"]["steps"], ctrl.guard.summary()["8"]["plain"]["steps"]
    ctrl.observe_step(StepShape.of(8, 0, 0, PAR), 0.008, 8, load=9)  # 8 decoding at load 9
    assert (ctrl.guard.summary()["16"]["plain"]["steps"], ctrl.guard.summary()["8"]["plain"]["steps"]) \
        == (steps[0] + 1, steps[1])
    ctrl.observe_step(StepShape.of(8, 0, 0, PAR), 0.008, 8)  # no load named: its requests'
    assert ctrl.guard.summary()["8"]["plain"]["steps"] == steps[1] + 1


def test_the_guard_overrules_a_fit_that_says_plain_where_speculation_was_faster():
    """The fit can miss a cost of plain steps (a real engine's step is not exactly linear in its
    rows and passes): where the engine realized speculation faster at a load, or has not measured
    it there yet, a plain plan from the fit gives way to the full depth for every request (the
    fixed-depth plan: a fit that misjudges speculating must not choose how deep it goes)."""
    dear = StepCost(c_0=0.01, c_req=0.0005, c_row=0.002, c_pass=0.004, c_draft_row=0.002)
    many = [f"r{i}" for i in range(32)]
    ctrl = _feed(DepthController(8, PAR, explore_every=1000), dear, 0.8, 81, many)
    assert ctrl.decide(many).draft_depth == 0  # the fit: plain
    for _ in range(200):  # (the simulated steps' measurement of speculation fades)
        ctrl.guard.observe(32, True, 96, 0.040)  # realized: speculation 75 per request-second
    assert ctrl.guard.speculation_faster(32)  # (plain realized 11-16)
    plans = [ctrl.decide(many) for _ in range(9)]
    assert all(p.draft_depth == 8 and set(p.depths.values()) == {8} for p in plans)
    # another load (5-8), where nothing is realized yet: a block of plain steps measures plain
    # decoding, then the fit's plain plan gives way too, so that the guard measures speculation
    # there (a plain plan would never measure it)
    eight = many[:8]
    for _ in range(PLAIN_SETTLE_STEPS + ctrl.guard.min_steps + 1):
        plan = ctrl.decide(eight)
        if plan.draft_depth:
            break
        assert plan.explored  # (the block)
        ctrl.observe_step(StepShape.of(8, 0, 0, PAR), 0.020, 8)
    assert ctrl.guard.knows(8, speculative=False) and not ctrl.guard.knows(8, speculative=True)
    assert plan.draft_depth == 8 and set(plan.depths.values()) == {8}


def test_a_tie_goes_to_plain_decoding_and_a_verdict_holds_within_the_band():
    """Speculation must be realized faster by more than ENTER_MARGIN to be chosen where the load
    decodes plainly: within it the load stays plain (the rates carry errors of several per cent;
    what speculating costs beyond its steps, requests finishing out of step and prompts admitted
    one by one, falls on its side), though the cost fit says speculate. Once speculating, it goes
    on while it leads by more than MARGIN (hysteresis: a reading between the two changes
    nothing), and a lead within MARGIN turns the load plain again."""
    assert MARGIN < 0.10 < ENTER_MARGIN < 0.20
    ctrl = _feed(DepthController(4, PAR, explore_every=1000), StepCost(0.01, 0.0, 0.0001, 0.001, 0.0001), 0.9, 30,
                 ["a", "b"])

    def speculation_reads(rate):  # 200 steps of each regime at 2 requests; plain: 100 per request-second
        for _ in range(200):  # (the simulated steps before fade from the estimates)
            ctrl.guard.observe(2, False, 2, 0.010)
            ctrl.guard.observe(2, True, 2 * rate / 100, 0.010)
        return ctrl.decide(["a", "b"]).draft_depth > 0

    assert not speculation_reads(104)  # a tie, within MARGIN
    assert not ctrl.guard.plain_faster(2) and not ctrl.guard.speculation_faster(2) and ctrl.guard.prefers_plain(2)
    assert not speculation_reads(110)  # ahead by more than MARGIN, not by ENTER_MARGIN: stays plain
    assert ctrl.guard.prefers_plain(2) and not ctrl.guard.speculation_faster(2)
    assert speculation_reads(120)  # beyond ENTER_MARGIN: speculates
    assert ctrl.guard.speculation_faster(2) and not ctrl.guard.prefers_plain(2)
    assert speculation_reads(110)  # back within the band: goes on speculating
    assert ctrl.guard.speculation_faster(2) and not ctrl.guard.prefers_plain(2)
    assert not speculation_reads(104)  # within MARGIN: plain again
    assert ctrl.guard.prefers_plain(2)


def test_the_two_margins_are_validated():
    with pytest.raises(ValueError, match="enter_margin"):
        ThroughputGuard(margin=0.2, enter_margin=0.1)
    assert ThroughputGuard(margin=0.3).enter_margin == 0.3  # the default never sits below `margin`
    assert ThroughputGuard().enter_margin == ENTER_MARGIN


def _speculate_with_plain_measured_at(plain_seconds: float) -> tuple[DepthController, list]:
    """200 decisions at 2 requests whose plain rate was once measured as 2 tokens per
    `plain_seconds` step, where speculation realizes 214 per request-second and plain decoding
    (whenever decided) now 250."""
    ctrl = _feed(DepthController(4, PAR, explore_every=1000), StepCost(0.01, 0.0, 0.0001, 0.001, 0.0001), 0.9, 40,
                 ["a", "b"])
    for _ in range(200):  # (the simulated steps before fade from the estimates)
        ctrl.guard.observe(2, False, 2, plain_seconds)
    spec = StepShape.of(2, 8, 4, PAR, spec_requests=2)
    plans = []
    for _ in range(200):
        plan = ctrl.decide(["a", "b"])
        plans.append(plan)
        if plan.draft_depth:
            ctrl.observe_step(spec, 0.014, 6)  # speculation: 214 per request-second
        else:
            ctrl.observe_step(StepShape.of(2, 0, 0, PAR), 0.004, 2)  # plain now: 250 per request-second
    return ctrl, plans


def test_plain_decoding_is_measured_afresh_in_blocks_while_speculating():
    """A plain rate measured once, amid speculation or on a slower machine, must not keep a load
    speculating forever where the two are close: once the speculative regime has run
    1 / retry_budget - 1 times as long as the last plain block took (and retry_every decisions),
    the guard forgets the plain rate and the load decodes plainly until min_steps plain steps have
    measured it again; where plain decoding is now the faster, it stays plain. Where speculation
    is far ahead of the plain rate (more than REFRESH_WITHIN) no block is worth its cost."""
    ctrl, plans = _speculate_with_plain_measured_at(0.005)  # once: 200 per request-second
    guard = ctrl.guard
    assert plans[0].draft_depth > 0
    block = next(i for i, p in enumerate(plans) if p.draft_depth == 0)
    # the last block took 5 plain steps of ~10 ms (in _feed): ~19 times that of speculation first
    assert block >= guard.retry_every and plans[block].explored
    assert all(p.draft_depth == 0 for p in plans[block:])  # measured afresh: plain is faster, it stays plain
    assert guard.prefers_plain(2) and guard.rate(2, speculative=False) == pytest.approx(250, rel=1e-3)
    ctrl, plans = _speculate_with_plain_measured_at(0.040)  # once: 25 per request-second
    assert all(p.draft_depth > 0 for p in plans)
    assert ctrl.guard.rate(2, speculative=False) == pytest.approx(25, rel=1e-3)


def test_a_load_met_first_in_a_plain_regime_waits_for_its_first_retry_by_the_fits_prediction():
    """Before any speculative step was measured at a load, the first retry waits as long as the
    cost fit's prediction of min_steps speculative steps there says (not at once: at 32 in flight
    a retry costs ~5 steps of 4 plain ones each)."""
    guard = ThroughputGuard(min_steps=1, retry_every=1)
    guard.spec_step_prior = lambda n: 0.010 * n  # a speculative step at 32: 0.32 s
    guard.observe(32, True, 32, 10.0)  # (speculation: far slower; its step time unmeasured below)
    guard._spec_step_seconds.clear()
    guard.observe(32, False, 32, 0.010)
    plain = 0
    while guard.plain_wins(32):
        guard.observe(32, False, 32, 0.010)
        plain += 1
    assert plain * 0.010 == pytest.approx(19 * 1 * 0.32, abs=0.011)  # 19x one (min_steps) predicted step


def test_fitting_often_or_rarely_gives_the_same_cost():
    """The cost model sums its steps in at the next fit (one numpy pass): the estimate does not
    depend on how often it is asked for."""
    gen = random.Random(5)
    shapes = [(StepShape.of(gen.randint(1, 32), gen.randint(0, 64), gen.randint(0, 8), PAR,
                            extra_rows=gen.choice([0, 0, 40]), spec_requests=0), gen.uniform(0.005, 0.05))
              for _ in range(300)]
    often, rarely = StepCostModel(), StepCostModel()
    fits = []
    for shape, seconds in shapes:
        often.update(shape, seconds)
        rarely.update(shape, seconds)
        fits.append(often.fit())
    assert np.allclose(rarely.fit().coefficients(), fits[-1].coefficients(), rtol=1e-9, atol=1e-12)


def test_a_load_above_one_where_plain_decoding_won_decodes_plainly_unmeasured():
    """The more requests a step runs, the dearer its extra query rows: where plain decoding won at
    9-16 in flight, 17-32 decodes plainly from its first step without speculating to measure it
    (no exploration, no retry, no drafts for a new wave), though the cost fit says speculate;
    once the lower load's retry puts speculation ahead, the fit decides again. A load below it
    is not concerned, nor a load that measured both regimes itself."""
    # (speculation wins at 32 however the fit splits its pass costs between passes and requests)
    truth = StepCost(0.01, 0.0, 0.0001, 0.0001, 0.0001)
    ctrl = _feed(DepthController(8, PAR, explore_every=4), truth, 0.9, 40, ["a"])  # the cost fit: speculate
    guard = ctrl.guard
    for _ in range(8):
        guard.observe(16, False, 16, 0.008)  # 9-16 running: plain 125 per request-second
        guard.observe(16, True, 24, 0.024)  # speculative 62.5
    many = [f"r{i}" for i in range(32)]
    assert guard.prefers_plain(32) and not guard.prefers_plain(8)
    plans = [ctrl.decide(many) for _ in range(300)]
    assert all(p.draft_depth == 0 and set(p.depths.values()) == {0} for p in plans)
    assert ctrl.draft_depth_for(32, 8) == 0 and guard.summary().get("32", {}).get("retries") is None
    for _ in range(60):
        guard.observe(16, True, 64, 0.024)  # speculation at 9-16 now 167 per request-second
    assert not guard.prefers_plain(32)
    block = ctrl.decide(many)  # the load's own plain rate first (it has none), then the fit's plan
    assert block.draft_depth == 0 and block.explored
    for _ in range(PLAIN_SETTLE_STEPS + guard.min_steps):  # (the first ones right after speculation settle)
        ctrl.observe_step(StepShape.of(32, 0, 0, PAR), truth(StepShape.of(32, 0, 0, PAR)), 32)
    assert guard.knows(32, speculative=False) and ctrl.decide(many).draft_depth > 0
    for _ in range(8):
        guard.observe(32, False, 32, 0.010)  # 17-32's own rates: speculation ahead there
        guard.observe(32, True, 96, 0.010)
    for _ in range(60):
        guard.observe(16, True, 24, 0.024)  # 9-16 plain again
    assert guard.prefers_plain(16) and not guard.prefers_plain(32)


def test_a_step_that_only_admits_prompts_drafts_for_the_load_it_admits():
    """A wave of prompts admitted after a run's last requests speculated at a low load: the step
    that only prefills must draft what the next step (the wave, at its own load) will verify,
    not the depth the low load left in force (at 32 in flight on the CPU such a step drafted 8
    tokens for each of 32 prompts, which the next, plain step dropped: 0.88x AR)."""
    cost = StepCost(c_0=0.01, c_req=0.0002, c_row=0.0004, c_pass=0.001, c_draft_row=0.0004)
    wave = [f"w{i}" for i in range(32)]
    ctrl = _feed(DepthController(8, PAR), cost, 0.8, 40, wave)
    assert ctrl.decide(wave).draft_depth == 0 and ctrl.guard.prefers_plain(32)  # measured: plain at 32
    _feed(ctrl, cost, 0.8, 40, ["last"])
    assert ctrl.decide(["last"]).draft_depth > 0  # the fit: speculate, for one request ...

    def fresh_plan(n):  # the solver's plan for n requests the acceptance estimates know nothing of
        return choose_depths(expected_committed(ctrl.tracker.population()[None].expand(n, 8)), ctrl.last_cost, PAR)[1]

    # ... and a prompt admitted alone drafts so too; a step admitting a wave of 32 drafts nothing
    assert ctrl.decide([], load=1).draft_depth == fresh_plan(1) > 0
    assert ctrl.decide([], load=32).draft_depth == 0
    # nor where the guard has measured plain decoding faster at another load
    for _ in range(8):
        ctrl.guard.observe(16, False, 16, 0.010)
        ctrl.guard.observe(16, True, 20, 0.016)
    assert ctrl.guard.prefers_plain(16) and ctrl.decide([], load=16).draft_depth == 0


def test_a_plain_regime_fits_its_costs_rarely():
    """While the guard decodes plainly it decides without the fit, which then only prices prompt
    chunks and retries: a fit every PLAIN_REFIT_EVERY steps, not every refit_every (in the engine
    a fit takes ~0.5 ms of the scheduler, a share of every plain step otherwise); where the fit
    decides, it is refreshed every refit_every steps."""
    ctrl = _feed(DepthController(8, PAR), StepCost(0.01, 0.0, 0.0001, 0.0001, 0.0001), 0.9, 40, ["a"])
    fits = []
    fit = ctrl.costs.fit
    ctrl.costs.fit = lambda: fits.append(ctrl.steps) or fit()
    many = [f"r{i}" for i in range(32)]
    for _ in range(8):
        ctrl.guard.observe(32, False, 32, 0.008)  # plain: 125 per request-second
        ctrl.guard.observe(32, True, 48, 0.024)  # speculative: 62.5
    for _ in range(3 * PLAIN_REFIT_EVERY):
        assert ctrl.decide(many).draft_depth == 0
    assert 2 <= len(fits) <= 4 and min(b - a for a, b in zip(fits, fits[1:])) >= PLAIN_REFIT_EVERY
    fits.clear()
    for _ in range(32):  # one request: the fit decides
        ctrl.decide(["a"])
    assert len(fits) == 32 // ctrl.refit_every


def test_a_load_the_fit_decodes_plainly_is_measured_speculating_before_it_decodes_plainly():
    """A fit misled by the start-up probe's slow first passes of new shapes (on the CPU; on a GPU,
    kernels compiled for them) says plain decoding where speculation is far faster: nothing would
    ever measure speculation at a load that never speculates (an in-process `sd` engine at 1 in
    flight decoded plainly for good). The guard speculates at the full depth wherever speculation
    has no realized rate, so the fit's plain plan is checked like any other. Where speculation
    really is slower (32 in flight below) it is measured once, then plain decoding stays, with
    the guard's rare retries."""

    class SlowFirstPasses:
        def __init__(self, cost, slow_steps):
            self.cost, self.left = cost, slow_steps

        def __call__(self, shape):
            self.left -= 1
            return self.cost(shape) * (20.0 if self.left >= 0 and shape.draft_passes else 1.0)

    cheap = StepCost(c_0=0.003, c_req=0.0, c_row=0.00002, c_pass=0.0005, c_draft_row=0.00002)
    ctrl = DepthController(5, SEQ, explore_every=1000)
    _feed(ctrl, SlowFirstPasses(cheap, len(ctrl.probe)), 0.9, len(ctrl.probe) + 1, ["a"])
    population = expected_committed(ctrl.tracker.population()[None])
    assert choose_depths(population, ctrl.costs.fit(), SEQ)[1] == 0  # the fit: plain
    _feed(ctrl, cheap, 0.9, 200, ["a"])  # (a block of plain steps first: plain decoding has no rate either)
    assert ctrl.guard.speculation_faster(1)
    plans = [ctrl.decide(["a"]) for _ in range(50)]
    assert all(p.draft_depth > 0 for p in plans)
    # speculation really slower: measured once (the switch, the load's first steps, min_steps counted)
    dear = StepCost(c_0=0.01, c_req=0.0005, c_row=0.002, c_pass=0.004, c_draft_row=0.002)
    many = [f"r{i}" for i in range(32)]
    ctrl = _feed(DepthController(8, PAR, explore_every=1000), dear, 0.8, 300, many)
    assert ctrl.guard.plain_faster(32) and ctrl.guard.summary()["32"]["speculative"]["steps"] == ctrl.guard.min_steps
    assert "retries" not in ctrl.guard.summary()["32"]  # (a first measurement, not a retry) ...
    drafted = ctrl.draft_depth_counts
    assert sum(n for d, n in drafted.items() if d) <= len(ctrl.probe) + 2 * ctrl.guard.min_steps + 1
    # ... though measured like one (a step's prompt rows out at the regime's steady step time)
    ctrl = _feed(DepthController(8, PAR, explore_every=1000), dear, 0.8, len(ctrl.probe) + 1, many)
    for _ in range(PLAIN_SETTLE_STEPS + 2 * ctrl.guard.min_steps):
        plan = ctrl.decide(many)
        if plan.draft_depth:
            break
        ctrl.observe_step(StepShape.of(32, 0, 0, PAR), dear(StepShape.of(32, 0, 0, PAR)), 32)
    assert plan.draft_depth == 8 and ctrl.guard.retrying(32)
    chunk = StepShape.of(32, 0, 8, PAR, extra_rows=500)  # (the switch's step admits the next wave)
    ctrl.observe_step(chunk, dear(chunk), 32)
    decode = StepShape.of(32, 256, 8, PAR, spec_requests=32)
    for _ in range(2 * ctrl.guard.min_steps - 2):  # (the load's first speculative steps are not counted)
        ctrl.observe_step(decode, dear(decode), 32 * 4)
    shape = StepShape.of(32, 256, 8, PAR, extra_rows=500, spec_requests=32)
    ctrl.observe_step(shape, dear(shape), 32 * 4)  # a chunk: out at the fit's price
    assert ctrl.guard.retrying(32)
    tokens, request_seconds = ctrl.guard._sums[(ctrl.guard.bucket(32), True)][:2]  # (decoding alone)
    assert tokens / request_seconds == pytest.approx(4 / dear(decode), rel=0.02)


def test_a_lower_loads_retry_leaves_its_verdict_to_the_loads_above():
    """17-32 in flight decodes plainly by 9-16's verdict; while 9-16 retries speculation (its
    speculative rate forgotten), 17-32 keeps that verdict rather than fall to the cost fit (which
    speculated at 32 in flight in mode `sd` at 0.62x plain decoding's rate); the retry's outcome
    then decides for both."""
    guard = ThroughputGuard(min_steps=4, retry_every=4, margin=0.02)
    for _ in range(8):
        guard.observe(16, False, 16, 0.008)  # 9-16: plain 125 per request-second
        guard.observe(16, True, 20, 0.016)  # speculative 78
    assert guard.prefers_plain(16) and guard.prefers_plain(32)
    for _ in range(1000):  # (a retry waits for 19 times its steps' time of plain decoding: ~160 steps)
        if not guard.plain_wins(16):  # (the call that starts it)
            break
        guard.observe(16, False, 16, 0.008)
    # 9-16 retries ...
    assert guard.retrying(16) and not guard.knows(16, speculative=True) and not guard.prefers_plain(16)
    assert guard.prefers_plain(32) and guard.plain_wins(32)  # ... 17-32 keeps its verdict
    for _ in range(4):
        guard.observe(16, True, 48, 0.008)  # the retry: speculation now 375 per request-second
    assert not guard.plain_wins(16) and not guard.prefers_plain(16)
    assert not guard.prefers_plain(32)  # the new verdict holds above too
