"""The guard's choice between plain decoding and speculation (vllm_prove/core/adaptive/guard.py):
paired readings, switches only on separated intervals, one exploration budget both ways, the model
as a prior that measurements must overturn, each arm charged its own prompt admissions. Driven by a small world of
known rates with seeded noise; the trace replay (test_core_guard_replay.py) checks the whole
controller on steps recorded from real engines."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_prove.core.adaptive import BLOCK_STEPS, EXPLORE_BUDGET, FREE_PAIRS, SETTLE_STEPS, SpeculationGuard
from vllm_prove.core.adaptive.guard import OWN_PRICE_STEPS


def drive(guard, plain_rate, spec_rate, steps, load=1, sigma=0.0, seed=0, prefill=None):
    """``steps`` steps at ``load``: each step in the arm the guard runs, ``load`` tokens (plain) or
    ``load * spec_rate / plain_rate`` (speculation) in ``1 / plain_rate`` seconds times lognormal
    noise; ``plain_rate`` and ``spec_rate`` may be callables of the step index. Returns the arms
    run and the seconds each took."""
    rng = np.random.default_rng(seed)
    arms, seconds = [], []
    for i in range(steps):
        p = plain_rate(i) if callable(plain_rate) else plain_rate
        s = spec_rate(i) if callable(spec_rate) else spec_rate
        speculative = guard.speculates(load)
        t = math.exp(sigma * rng.standard_normal()) / p
        tokens = load * (s / p if speculative else 1.0)
        extra = prefill(i) if prefill else 0.0
        guard.observe(load, speculative, tokens, t + extra, load, prefill_seconds=extra)
        arms.append(speculative)
        seconds.append(t + extra)
    return np.array(arms), np.array(seconds)


def test_a_clear_winner_is_found_and_kept():
    for plain, spec in ((100, 160), (160, 100)):
        guard = SpeculationGuard()  # (no model: plain decoding first)
        arms, _ = drive(guard, plain, spec, 3000, sigma=0.1)
        winner = spec > plain
        state = guard.state(1)
        assert state.in_force == winner and state.switches == int(winner)
        assert guard.summary()["1"]["started"] == "plain"  # (a bucket met before any model: plain)
        assert (arms[500:] != winner).mean() < 0.05  # the loser only in exploration blocks
        assert state.pairs.blocks >= FREE_PAIRS


def test_no_switch_on_noise_between_equal_arms():
    """Equal arms, 15% noise per step: the in-force arm stays (a threshold inside the noise
    switched with every reading)."""
    switches = []
    for seed in range(5):
        guard = SpeculationGuard()
        drive(guard, 100, 100, 4000, sigma=0.15, seed=seed)
        switches.append(guard.state(1).switches)
    assert sum(switches) <= 1, switches


def test_a_drift_of_the_machine_cancels_in_the_pairs():
    """The machine slows down 2x over the run, the same for both arms: a speculation 25% ahead is
    found all the same (each reading is a block against its neighbours, minutes apart never)."""
    slow = lambda i: 1 - 0.5 * i / 4000  # noqa: E731
    guard = SpeculationGuard()
    arms, _ = drive(guard, lambda i: 100 * slow(i), lambda i: 125 * slow(i), 4000, sigma=0.05)
    assert guard.state(1).in_force and arms[-1500:].mean() > 0.9
    guard = SpeculationGuard()
    drive(guard, lambda i: 100 * slow(i), lambda i: 100 * slow(i), 4000, sigma=0.05)
    assert guard.state(1).switches == 0


def test_exploration_gives_up_a_bounded_share_of_throughput_both_ways():
    """The arm not in force is measured now and then (retries of speculation where plain decoding
    wins, re-measurements of plain decoding where speculation wins: one mechanism, one budget),
    and what it costs stays within EXPLORE_BUDGET of the throughput, beyond the first pairs."""
    for plain, spec in ((100, 60), (60, 100)):
        guard = SpeculationGuard()
        arms, seconds = drive(guard, plain, spec, 12000, sigma=0.05)
        state = guard.state(1)
        assert state.in_force == (spec > plain) and state.explored > FREE_PAIRS + 1  # measured again
        rate = np.where(arms, spec, plain)
        loss = 1 - (rate * seconds).sum() / (max(plain, spec) * seconds.sum())
        first = FREE_PAIRS * (2 * BLOCK_STEPS + 2) / 12000  # the first pairs, a whole block settling
        assert loss <= EXPLORE_BUDGET + first, loss


def test_readings_wait_for_the_budget_where_the_model_expects_little_at_stake():
    """Where the model cannot predict, or predicts a lead inside its own error, a bucket's first
    exploration waits until its throughput can carry the exploration's two switches within
    EXPLORE_BUDGET (an explored block of speculation at 16 in flight scatters the finishing
    steps of requests that would finish together); where it predicts much at stake, the first
    pairs run at once."""
    for prior in (None, 0.1, -0.1):
        guard = SpeculationGuard(prior=lambda load, p=prior: p)
        arms, _ = drive(guard, 100, 100, 600, load=16, sigma=0.05)
        first = int(np.argmax(arms)) if arms.any() else len(arms)
        assert first >= 2 / EXPLORE_BUDGET, (prior, first)  # (two switch steps at 1%: 200 steps)
        assert guard.state(16).in_force is False
    guard = SpeculationGuard(prior=lambda load: 0.3)  # (1.35x: at stake, inside the interval)
    arms, _ = drive(guard, 100, 100, 600, load=16, sigma=0.05)
    assert 0 < int(np.argmax(arms)) <= 3 * BLOCK_STEPS and guard.state(16).pairs.blocks >= FREE_PAIRS


def test_a_model_prior_survives_a_slow_warm_up_but_not_a_consistent_loss():
    """The model predicts speculation 1.6x plain decoding. A warm-up in which speculation reads
    0.8x of plain does not turn the load plain; a speculation that stays at 0.7x does, soon."""
    prior = math.log(1.6)
    guard = SpeculationGuard(prior=lambda load: prior)
    arms, _ = drive(guard, 100, lambda i: 80 if i < 40 else 160, 1500, sigma=0.1)
    assert guard.state(1).switches == 0 and arms[100:].mean() > 0.9
    guard = SpeculationGuard(prior=lambda load: prior)
    arms, _ = drive(guard, 100, 70, 1500, sigma=0.1)
    assert not guard.state(1).in_force
    assert (~arms[400:]).mean() > 0.9  # within a few pairs it decodes plainly


def test_a_change_of_the_machine_is_followed():
    """Speculation wins, then plain decoding does (another load on the machine, a new kernel):
    the stale readings fade, the arm not in force is measured again within the budget and the
    in-force arm follows."""
    guard = SpeculationGuard()
    arms, _ = drive(guard, 100, lambda i: 150 if i < 2000 else 70, 12000, sigma=0.05)
    assert guard.state(1).in_force is False and guard.state(1).switches == 2  # (plain, speculation, plain)
    assert (~arms[-2000:]).mean() > 0.9


def test_switch_and_settle_steps_and_prompt_rows_do_not_bias_a_block():
    """A step of the arm the bucket is not running and the first SETTLE_STEPS of a run count only
    as time; a wave of prompts in one step of a block is taken out of the block and charged per
    prompt, spread over the tokens a request commits."""
    guard = SpeculationGuard(prior=lambda load: 0.5)
    state = guard.state(4)
    assert state.running  # (the model's arm first: 1.65x, beyond the interval)
    guard.observe(4, False, 4, 0.5, 4)  # a plain step while speculation runs: a switch
    for _ in range(BLOCK_STEPS):
        guard.observe(4, True, 4, 0.5, 4)  # the arm's first run at the load: a block settles, uncounted
    assert state.steps == 0 and state.seconds == pytest.approx(0.5 * (1 + BLOCK_STEPS))
    for i in range(BLOCK_STEPS):  # a block at 8 tokens per 0.01 s per 4 requests, one step with a wave of 4
        wave = 0.3 if i == 3 else 0.0
        guard.observe(4, True, 8, 0.01 + wave, 4, prefill_seconds=wave, admitted=4 if wave else 0)
    spec = state.arms[True]
    # the decoding rate is 200 tokens per request-second (the wave's step out); a prompt costs
    # 0.3 s x 4 requests / 4 prompts (the fit's price: one step with prompt rows), spread over
    # the tokens committed so far per prompt admitted (no request has finished)
    per_token = (0.3 * 4 / 4) / ((4 + 4 * BLOCK_STEPS + 8 * BLOCK_STEPS) / 4)
    assert guard.prompt_price(True) == pytest.approx(per_token)
    assert math.exp(spec.mean) == pytest.approx(56 / (0.01 * 4 * (BLOCK_STEPS - 1) + 56 * per_token))
    assert not state.running  # plain decoding, never measured here, is measured next ...
    for _ in range(SETTLE_STEPS + 1):
        guard.observe(4, True, 8, 0.01, 4)  # (the switch: drafts of the last speculative step)
    assert state.settle == BLOCK_STEPS  # ... after its own new shapes settle
    assert guard.summary()["4"]["speculative"]["steps"] == BLOCK_STEPS


def test_admission_is_priced_per_prompt_over_a_requests_life():
    """A wave of 16 prompts in one plain step and a speculative step that admits one: each arm's
    own price per prompt once it has OWN_PRICE_STEPS such steps, spread over the finished
    requests' mean length, the same for both arms (a ratio over the tokens an arm has committed so
    far charged the wave of a short run to its first few tokens)."""
    guard = SpeculationGuard(prior=lambda load: 1.0 if load > 16 else -1.0)  # (plain at 16, speculation at 32)
    for load, arm, extra, prompts in ((16, False, 0.08, 16), (32, True, 0.03, 1)):
        guard.observe(load, arm, 16, 0.01, 16)  # (a step without prompt rows: the arm's decode step)
        for _ in range(OWN_PRICE_STEPS):
            guard.observe(load, arm, 16, 0.01 + extra, 16, prefill_seconds=0.005, admitted=prompts)
    # (nothing finished, no limit known: tokens committed so far per prompt admitted, a lower bound)
    assert guard.tokens_per_request() == pytest.approx(16 * 2 * (1 + OWN_PRICE_STEPS) / (16 + 1) / OWN_PRICE_STEPS)
    guard.expect(64)
    assert guard.tokens_per_request() == 64  # (nothing finished: the admitted requests' limit)
    for tokens in (40, 56):
        guard.finished(tokens)
    assert guard.tokens_per_request() == pytest.approx((40 + 56 + 64) / 3)
    assert guard.admission_price(False) == pytest.approx(0.08 * 16 / 16)
    assert guard.admission_price(True) == pytest.approx(0.03 * 16 / 1)
    assert guard.prompt_price(True) / guard.prompt_price(False) == pytest.approx(6.0)
    assert guard.prompt_price(False) == pytest.approx(0.08 / ((40 + 56 + 64) / 3))


def drive_admissions(guard, spec_gain, admit_extra, steps, load=16, every=6, fit_price=0.2, sigma=0.05, seed=0):
    """Steps of 1 time unit at ``load``; speculation commits ``spec_gain`` x plain's tokens per step;
    every ``every``-th step admits a prompt, costing ``admit_extra[arm]`` units more, while the cost
    fit prices the prompt rows at ``fit_price`` for both arms. Returns the arms run."""
    rng = np.random.default_rng(seed)
    arms = []
    for i in range(steps):
        speculative = guard.speculates(load)
        admits = i % every == 0
        extra = admit_extra[speculative] if admits else 0.0
        t = math.exp(sigma * rng.standard_normal()) * 0.01 * (1 + extra)
        tokens = load * (spec_gain if speculative else 1.0)
        guard.observe(load, speculative, tokens, t, load, prefill_seconds=0.01 * fit_price if admits else 0.0,
                      admitted=int(admits))
        arms.append(speculative)
    return np.array(arms)


@pytest.mark.parametrize("spec_extra, plain_extra, winner", [(1.5, 0.2, False), (0.2, 1.5, True)])
def test_each_arm_pays_its_own_price_for_admitting_prompts(spec_extra, plain_extra, winner):
    """Speculation decodes 8% faster but, its requests finishing at staggered steps, admits prompts
    beside speculative steps that cost far more than plain decoding's admissions (and mirrored):
    per 6 steps 6.48 tokens in 7.5 units against 6 in 6.2, a 12% loss the fit's prompt price (alike
    for both arms) cannot see. The guard must charge each arm what its own admissions took."""
    guard = SpeculationGuard(prior=lambda load: math.log(1.08 if winner is False else 0.9))
    arms = drive_admissions(guard, 1.08 if winner is False else 0.9, {True: spec_extra, False: plain_extra}, 6000)
    state = guard.state(16)
    assert state.in_force is winner, guard.summary()
    assert (arms[-2000:] == winner).mean() > 0.9
    assert guard.prompt_price(True) != pytest.approx(guard.prompt_price(False), rel=0.5)


def test_buckets_are_loads_of_up_to_a_power_of_two_and_summaries_are_json_ready():
    assert [SpeculationGuard.bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    guard = SpeculationGuard(prior=lambda load: -0.5)
    assert not guard.speculates(16)  # the model's arm first
    drive(guard, 100, 50, 600, load=16)
    entry = guard.summary()["16"]
    assert entry["started"] == "plain" and entry["switches"] == 0
    assert entry["arm"] == "plain" and entry["model_ratio"] == pytest.approx(math.exp(-0.5), abs=1e-3)
    assert entry["ratio_interval"][0] < entry["ratio"] < entry["ratio_interval"][1] < 1


def test_a_bucket_met_before_the_model_can_tell_takes_the_models_arm_when_it_can():
    """A fresh engine meets its first load a step or two before the cost fit has its terms: plain
    decoding is a placeholder there, replaced by speculation at the first block end at which the
    model puts it ahead beyond the interval; a weak lead (inside the interval) leaves plain
    decoding in force for the readings to overturn."""
    def prior_after(calls, value):
        return lambda load, n=[0]: (n.__setitem__(0, n[0] + 1), None if n[0] < calls else value)[1]

    guard = SpeculationGuard(prior=prior_after(2, 0.5))  # (1.65x: beyond 2 * MODEL_SPREAD)
    assert not guard.speculates(1)  # (the model cannot tell yet)
    arms, _ = drive(guard, 100, 165, 600, sigma=0.05)
    entry = guard.summary()["1"]
    assert entry["started"] == entry["arm"] == "speculative" and entry["switches"] == 0
    assert arms[3 * BLOCK_STEPS:].mean() > 0.9
    weak = SpeculationGuard(prior=prior_after(2, 0.25))  # (1.28x: inside the interval)
    arms, _ = drive(weak, 100, 128, 600, sigma=0.05)
    entry = weak.summary()["1"]
    assert entry["started"] == "plain" and entry["arm"] == "speculative" and entry["switches"] == 1
    assert arms[-300:].mean() > 0.9
    # a bucket the model cannot tell runs no exploration until the budget pays for one (its first
    # pairs are free only where the model expects much at stake), so a model that speaks late
    # still finds the placeholder unread and replaces it; readings that contradict it (speculation
    # at 0.6x) then overturn it within its first pairs
    late = SpeculationGuard(prior=prior_after(8, 0.5))
    arms, _ = drive(late, 100, 60, 300, sigma=0.05)
    entry = late.summary()["1"]
    assert entry["started"] == "speculative" and entry["switches"] == 1 and not late.state(1).in_force
    assert arms[-100:].mean() < 0.2
