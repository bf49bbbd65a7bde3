"""The guard's choice between plain decoding and speculation (vllm_prove/core/adaptive/guard.py):
switches only on separated intervals, one exploration budget both ways, the model as a prior that
measurements must overturn, prompt rows priced alike. Driven by a small world of known rates with
seeded noise; the trace replay (test_core_guard_replay.py) checks the whole controller."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_prove.core.adaptive import BLOCK_STEPS, EXPLORE_BUDGET, SETTLE_STEPS, SpeculationGuard


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


def test_a_clear_winner_is_found_from_either_start_and_kept():
    for plain, spec in ((100, 160), (160, 100)):
        guard = SpeculationGuard()  # (no model: speculation first)
        arms, _ = drive(guard, plain, spec, 3000, sigma=0.1)
        winner = spec > plain
        assert guard.state(1).in_force == winner
        late = arms[500:]
        assert (late != winner).mean() < 0.05  # the loser only in exploration blocks
    assert guard.state(1).switches == 1


def test_no_switch_on_noise_between_equal_arms():
    """Equal arms, 15% noise per step: the in-force arm stays (a threshold inside the noise
    switched with every reading)."""
    switches = []
    for seed in range(5):
        guard = SpeculationGuard()
        drive(guard, 100, 100, 4000, sigma=0.15, seed=seed)
        switches.append(guard.state(1).switches)
    assert sum(switches) <= 1, switches


def test_exploration_gives_up_a_bounded_share_of_throughput_both_ways():
    """The arm not in force is measured now and then (retries of speculation where plain decoding
    wins, re-measurements of plain decoding where speculation wins: one mechanism, one budget),
    and what it costs stays within EXPLORE_BUDGET of the throughput, beyond the first measurement."""
    for plain, spec in ((100, 60), (60, 100)):
        guard = SpeculationGuard()
        arms, seconds = drive(guard, plain, spec, 6000, sigma=0.05)
        state = guard.state(1)
        in_force = spec > plain
        assert state.in_force == in_force and state.explored >= 3  # measured again, not once for good
        tokens_per_s = np.where(arms, spec, plain)
        best = max(plain, spec)
        loss = 1 - (tokens_per_s * seconds).sum() / (best * seconds.sum())
        first = (BLOCK_STEPS + SETTLE_STEPS + 1) / 6000  # the first measurement of the other arm
        assert loss <= EXPLORE_BUDGET + first, loss


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
    assert np.flatnonzero(~arms)[0] < 20 * BLOCK_STEPS  # measured plain within a few blocks ...
    assert (~arms[400:]).mean() > 0.9  # ... and decodes plainly


def test_a_change_of_the_machine_is_followed():
    """Speculation wins, then plain decoding does (another load on the machine, a new kernel):
    the stale arm is measured again within the budget and the in-force arm follows."""
    guard = SpeculationGuard()
    arms, _ = drive(guard, 100, lambda i: 150 if i < 2000 else 70, 8000, sigma=0.05)
    assert guard.state(1).in_force is False and guard.state(1).switches == 1
    assert (~arms[-1000:]).mean() > 0.9


def test_switch_and_settle_steps_and_prompt_rows_do_not_bias_a_block():
    """A step of the arm the bucket is not running and the first SETTLE_STEPS of a run count only
    as time; a wave of prompts in one step of a block is priced per token for both arms alike."""
    guard = SpeculationGuard()
    state = guard.state(4)
    assert state.running  # (no model: speculation first)
    guard.observe(4, False, 4, 0.5, 4)  # a plain step while speculation runs: a switch
    for _ in range(SETTLE_STEPS):
        guard.observe(4, True, 4, 0.5, 4)  # settling: slow and not counted
    assert state.steps == 0 and state.seconds == pytest.approx(0.5 * (1 + SETTLE_STEPS))
    for i in range(BLOCK_STEPS):  # a block at 8 tokens per 0.01 s per 4 requests, one step with a wave
        wave = 0.3 if i == 3 else 0.0
        guard.observe(4, True, 8, 0.01 + wave, 4, prefill_seconds=wave)
    spec = state.arms[True]
    # the decoding rate is 200 tokens per request-second; the wave's price spread over the tokens
    per_token = 0.3 * 4 / (64 + 4 + 4 * SETTLE_STEPS)
    assert math.exp(spec.mean) == pytest.approx(64 / (0.01 * 4 * BLOCK_STEPS + 64 * per_token))
    assert not state.running  # plain decoding, never measured here, is measured next
    assert guard.summary()["4"]["speculative"]["steps"] == BLOCK_STEPS


def test_buckets_are_loads_of_up_to_a_power_of_two_and_summaries_are_json_ready():
    assert [SpeculationGuard.bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    guard = SpeculationGuard(prior=lambda load: -0.5)
    assert not guard.speculates(16)  # the model's arm first
    drive(guard, 100, 50, 400, load=16)
    entry = guard.summary()["16"]
    assert entry["arm"] == "plain" and entry["model_ratio"] == pytest.approx(math.exp(-0.5), abs=1e-3)
    assert entry["ratio_interval"][0] < entry["ratio"] < entry["ratio_interval"][1] < 1
