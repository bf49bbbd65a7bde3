"""Whether to speculate at a load: a two-armed choice between plain decoding and speculation,
made on measured throughput with confidence intervals (docs/METHODS.md §9, "Whether to
speculate", states the policy and the reason for each knob below).

Per load bucket the guard runs one arm at a time in *blocks* of ``BLOCK_STEPS`` counted steps.
A block's value is its log committed tokens per request-second; each arm keeps a discounted mean
of its blocks (every block at the bucket weighs the past by ``DISCOUNT``, so an arm not run lately
carries less weight), and the noise of one block is estimated from the blocks' own scatter.
The statistic is ``d = log(rate_speculate / rate_plain)``:

    data       d^  = mean_S - mean_P,        var = noise * (1 / w_S + 1 / w_P)
    prior      d_0 = the cost model's predicted log ratio,   var = MODEL_SPREAD ** 2
    posterior  the precision-weighted mean of the two, and its standard deviation s

The arm *in force* changes only when the posterior interval ``d +- CONFIDENCE_Z * s`` excludes 0
(the noise sets the hysteresis). The other arm is *explored* (one block) while the data alone
cannot tell the arms apart, within one budget for both directions: exploration gives up at most
``EXPLORE_BUDGET`` of the bucket's throughput, an explored block charged its time times the
explored arm's shortfall (at least ``1 / BLOCK_STEPS``: the switch itself costs about a step).
An arm never measured at a bucket is measured once, whatever the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

# The five knobs (docs/METHODS.md §9 gives each one's reason).
BLOCK_STEPS = 8  # counted steps per block: a block's rate averages step jitter and prompt chunks
DISCOUNT = 0.98  # weight of a bucket's past blocks per new block there (a memory of ~50 blocks)
CONFIDENCE_Z = 2.0  # an interval is mean +- this many standard deviations (one-sided ~97.7%)
EXPLORE_BUDGET = 0.01  # at most this share of a bucket's throughput goes to exploring
MODEL_SPREAD = 0.2  # the cost model's error on the log rate ratio (and a block's noise before any is measured)

SETTLE_STEPS = BLOCK_STEPS // 4  # a run's first steps after a switch are not counted (caches, new shapes)


@dataclass
class ArmStats:
    """One arm at one bucket: a discounted mean of its blocks' log rates."""

    weight: float = 0.0  # discounted number of blocks
    mean: float = 0.0  # discounted mean of log(tokens per request-second)
    blocks: int = 0
    steps: int = 0  # counted steps of its blocks

    def add(self, value: float, steps: int) -> None:
        self.weight += 1.0
        self.mean += (value - self.mean) / self.weight
        self.blocks += 1
        self.steps += steps


@dataclass
class BucketState:
    """A load bucket's arms, the arm in force, and the block being measured."""

    in_force: bool  # True: speculation is the arm in force
    running: bool  # the arm its steps run now (the one in force, or one being explored)
    arms: dict = field(default_factory=lambda: {False: ArmStats(), True: ArmStats()})
    settle: int = 0  # steps of the running arm still to leave out
    tokens: float = 0.0  # the block so far: committed tokens ...
    request_seconds: float = 0.0  # ... seconds times requests ...
    steps: int = 0  # ... and counted steps
    block_seconds: float = 0.0  # every step's time since the last block ended (transitions too)
    seconds: float = 0.0  # every step's time at the bucket
    explore_cost: float = 0.0  # throughput-seconds given up to exploring
    prior: float | None = None  # the model's log ratio when last asked
    switches: int = 0
    explored: int = 0  # blocks run on the arm not in force


class SpeculationGuard:
    """Plain decoding or speculation, per load bucket (module docstring). ``prior(load)`` gives the
    cost model's predicted ``log(rate_speculate / rate_plain)`` at a load, or None before a fit."""

    def __init__(self, prior: Callable[[int], float | None] | None = None) -> None:
        self.prior = prior
        self._buckets: dict[int, BucketState] = {}
        self._noise = [MODEL_SPREAD ** 2, 1.0]  # [weighted squared residuals, weight]: one prior block
        self._prompt_price = [0.0, 0.0]  # [request-seconds of prompt rows, committed tokens], the engine's life

    @staticmethod
    def bucket(num_requests: int) -> int:
        """1 | 2 | 3-4 | 5-8 | 9-16 | ...: a load of up to n in flight stays in one bucket while its
        steps dip below n (between a finish and the admission that replaces it)."""
        return (max(1, num_requests) - 1).bit_length()

    def speculates(self, load: int) -> bool:
        """The arm the bucket of ``load`` runs now (a bucket met for the first time starts with
        the arm the model predicts, speculation where it cannot tell)."""
        return self.state(load).running

    def observe(self, load: int, speculative: bool, committed: int | None, seconds: float, requests: int,
                prefill_seconds: float = 0.0) -> None:
        """A step decided at ``load``: ``requests`` requests ran for ``seconds`` and committed
        ``committed`` tokens (None: a step that only admitted prompts); ``prefill_seconds`` of it
        were its prompt rows' (the cost fit's price). A block's rate is its decoding alone plus,
        per committed token, the traffic's prompt price per token over the engine's life (the
        same for both arms: which block a wave of prompts lands in is chance, and charged as they
        come they would make one block in a few 2-3x slower than the rest). A step of the arm the
        bucket is not running (the switch between arms) and the first ``SETTLE_STEPS`` of a run
        count only as time."""
        if seconds <= 0 or requests <= 0:
            return
        prefill_seconds = min(max(prefill_seconds, 0.0), seconds)
        self._prompt_price[0] += prefill_seconds * requests
        self._prompt_price[1] += committed or 0
        state = self.state(load)
        state.seconds += seconds
        state.block_seconds += seconds
        if speculative != state.running or committed is None:
            return
        if state.settle > 0:
            state.settle -= 1
            return
        state.tokens += committed
        state.request_seconds += (seconds - prefill_seconds) * requests
        state.steps += 1
        if state.steps >= BLOCK_STEPS:
            self._end_block(state, load)

    def interval(self, load: int) -> tuple[float, float, float]:
        """The posterior ``(mean, low, high)`` of ``log(rate_speculate / rate_plain)`` at the load."""
        mean, sd = self._posterior(self.state(load))
        return mean, mean - CONFIDENCE_Z * sd, mean + CONFIDENCE_Z * sd

    def noise(self) -> float:
        """A block's standard deviation in log rate, as measured (pooled over every bucket)."""
        return math.sqrt(self._noise[0] / self._noise[1])

    def state(self, load: int) -> BucketState:
        """The bucket of ``load`` (created on first use, starting with the arm the model predicts)."""
        bucket = self.bucket(load)
        state = self._buckets.get(bucket)
        if state is None:  # (created once per bucket: the model's view is its first arm)
            prior = self.prior(load) if self.prior is not None else None
            first = prior is None or prior >= 0
            state = self._buckets[bucket] = BucketState(in_force=first, running=first, prior=prior, settle=SETTLE_STEPS)
        return state

    def _end_block(self, state: BucketState, load: int) -> None:
        seconds_rows, tokens = self._prompt_price
        per_token = seconds_rows / tokens if tokens else 0.0  # request-seconds of prompt rows per token
        value = math.log(max(state.tokens, 1e-9) / (max(state.request_seconds, 1e-12) + state.tokens * per_token))
        arm = state.arms[state.running]
        if arm.weight > 0:  # its scatter about the arm's mean so far (that mean's own error taken out)
            residual = (value - arm.mean) ** 2 / (1 + 1 / arm.weight)
            self._noise = [DISCOUNT * self._noise[0] + residual, DISCOUNT * self._noise[1] + 1.0]
        for stats in state.arms.values():
            stats.weight *= DISCOUNT
        arm.add(value, state.steps)
        if state.running != state.in_force:
            state.explored += 1
            in_force = state.arms[state.in_force]
            shortfall = max(0.0, 1.0 - math.exp(value - in_force.mean)) if in_force.weight else 0.0
            state.explore_cost += state.block_seconds * max(shortfall, 1.0 / BLOCK_STEPS)
        state.tokens = state.request_seconds = state.block_seconds = 0.0
        state.steps = 0
        if self.prior is not None:
            state.prior = self.prior(load)
        mean, sd = self._posterior(state)
        if abs(mean) > CONFIDENCE_Z * sd and (mean > 0) != state.in_force:
            state.in_force = mean > 0
            state.switches += 1
        self._run(state, self._next_arm(state))

    def _next_arm(self, state: BucketState) -> bool:
        other = not state.in_force
        if state.arms[other].blocks == 0:
            return other  # never measured here: measured once, whatever the budget
        if not self._data_separated(state) and state.explore_cost <= EXPLORE_BUDGET * state.seconds:
            return other
        return state.in_force

    def _run(self, state: BucketState, arm: bool) -> None:
        if arm != state.running:
            state.running, state.settle = arm, SETTLE_STEPS

    def _data_variance(self, state: BucketState) -> float | None:
        plain, spec = state.arms[False], state.arms[True]
        if plain.weight <= 0 or spec.weight <= 0:
            return None
        return self.noise() ** 2 * (1 / plain.weight + 1 / spec.weight)

    def _data_separated(self, state: BucketState) -> bool:
        var = self._data_variance(state)
        gap = state.arms[True].mean - state.arms[False].mean
        return var is not None and abs(gap) > CONFIDENCE_Z * math.sqrt(var)

    def _posterior(self, state: BucketState) -> tuple[float, float]:
        precision = total = 0.0
        if state.prior is not None:
            precision, total = 1 / MODEL_SPREAD ** 2, state.prior / MODEL_SPREAD ** 2
        var = self._data_variance(state)
        if var is not None:
            precision += 1 / var
            total += (state.arms[True].mean - state.arms[False].mean) / var
        if precision == 0:
            return 0.0, math.inf
        return total / precision, precision ** -0.5

    def summary(self) -> dict:
        """Per bucket (by its largest load): each arm's measured rate, steps and blocks, the arm in
        force, the posterior ratio speculation / plain with its interval, the model's ratio."""
        out = {}
        for bucket, state in sorted(self._buckets.items()):
            entry = out[str(2 ** bucket)] = {"arm": "speculative" if state.in_force else "plain",
                                             "switches": state.switches, "explored_blocks": state.explored}
            for speculative, stats in state.arms.items():
                if stats.blocks:
                    entry["speculative" if speculative else "plain"] = {
                        "tok_per_req_s": round(math.exp(stats.mean), 1), "steps": stats.steps, "blocks": stats.blocks}
            mean, sd = self._posterior(state)
            if math.isfinite(sd):
                entry["ratio"] = round(math.exp(mean), 3)
                entry["ratio_interval"] = [round(math.exp(mean - CONFIDENCE_Z * sd), 3),
                                           round(math.exp(mean + CONFIDENCE_Z * sd), 3)]
            if state.prior is not None:
                entry["model_ratio"] = round(math.exp(state.prior), 3)
        return out
