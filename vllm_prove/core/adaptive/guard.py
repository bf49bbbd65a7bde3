"""Whether to speculate at a load: a two-armed choice between plain decoding and speculation,
made on measured throughput with confidence intervals (docs/METHODS.md §9, "Whether to
speculate", states the policy and the reason for each knob below).

Per load bucket the guard runs one arm at a time in *blocks* of ``BLOCK_STEPS`` counted steps; a
block's value is its log committed tokens per request-second. The arm *in force* runs; now and
then one block of the other arm is run between two blocks of it, and the *pair* gives one reading
of the statistic ``d = log(rate_speculate / rate_plain)``: the other arm's block against the mean
of its neighbours, so that the machine's slow drift cancels. The pairs are averaged with weights
that every block at the bucket multiplies by ``DISCOUNT`` (a reading grows stale), and their
noise is estimated from their own scatter:

    data       d^  = discounted mean of the pairs,   var = noise ** 2 / (their weight)
    prior      d_0 = the cost model's predicted log ratio,   var = MODEL_SPREAD ** 2
    posterior  the precision-weighted mean of the two, and its standard deviation s

The arm in force changes only when the posterior interval ``d +- CONFIDENCE_Z * s`` excludes 0
(the noise sets the hysteresis). The other arm is *explored* (one block) while the data alone do
not put the arm in force ahead, within one budget for both directions: exploration gives up at most
``EXPLORE_BUDGET`` of the bucket's throughput, an explored block charged its two switches (about a
step each, charged up front: a bucket's first exploration waits until its throughput can carry
one) and its time times the explored arm's shortfall as the posterior has it (an arm expected to
be the faster one earns its gain back). Where the model expects a lead of at least its own error
either way (``|prior| >= MODEL_SPREAD``), a bucket's first ``FREE_PAIRS`` pairs run whatever the
budget (one reading has no scatter, and a model fitted on a few warm-up steps may be far off);
where it expects less, or cannot predict, readings wait for the budget. An arm's first run at a
bucket lets a whole block of its new step shapes settle first. A bucket starts with speculation
only where the model alone puts it ahead beyond the interval (``prior > CONFIDENCE_Z *
MODEL_SPREAD``); elsewhere, and before the model can predict, it starts with plain decoding, the
arm the guard answers to, and the readings decide.

Admitting prompts is priced per arm and per prompt: what an arm's steps with prompt rows took
beyond its steps without, times their requests, per prompt they admitted, spread over the tokens a
request commits in its life (finished requests' mean output length, shared by both arms).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

# The five knobs (docs/METHODS.md §9 gives each one's reason); the two constants after them are
# structural (a switch's cost in steps, the readings a scatter needs), not tuned.
BLOCK_STEPS = 8  # counted steps per block: a block's rate averages step jitter and prompt chunks
DISCOUNT = 0.99  # weight of a bucket's past blocks per new block there (a memory of ~100 blocks)
CONFIDENCE_Z = 2.0  # an interval is mean +- this many standard deviations (one-sided ~97.7%)
EXPLORE_BUDGET = 0.01  # at most this share of a bucket's throughput goes to exploring
MODEL_SPREAD = 0.2  # the cost model's error on the log rate ratio (and a pair's noise before any is measured)

SETTLE_STEPS = BLOCK_STEPS // 4  # a run's first steps after a switch are not counted (caches, new shapes)
FREE_PAIRS = 2  # a bucket's first pairs where the model expects much at stake (one reading has no scatter)
OWN_PRICE_STEPS = BLOCK_STEPS  # an arm's steps with prompt rows before its own admission price replaces the fit's


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
    steps: int = 0  # ... and counted steps (those with prompt rows too) ...
    mixed: list = field(default_factory=lambda: [0.0, 0.0])  # ... of which with prompt rows: tokens, request-seconds
    block_seconds: float = 0.0  # every step's time since the last block ended (transitions too) ...
    block_steps: int = 0  # ... and its steps
    step_seconds: float = 0.0  # a step's mean time in the last block
    decode_step: dict = field(default_factory=lambda: {False: 0.0, True: 0.0})  # per arm: a recent step without prompt rows
    seconds: float = 0.0  # every step's time at the bucket
    explore_cost: float = 0.0  # throughput-seconds given up to exploring
    pairs: ArmStats = field(default_factory=ArmStats)  # readings of d: the discounted mean of the pairs
    before: float | None = None  # the in-force arm's last block value (a pair's first neighbour)
    pending: tuple | None = None  # (explored arm, its block value, the block before), awaiting the block after
    prior: float | None = None  # the model's log ratio when last asked
    started: bool = False  # the bucket's first arm (speculation where the model alone puts it ahead)
    switches: int = 0
    explored: int = 0  # blocks run on the arm not in force


class SpeculationGuard:
    """Plain decoding or speculation, per load bucket (module docstring). ``prior(load)`` gives the
    cost model's predicted ``log(rate_speculate / rate_plain)`` at a load, or None before a fit."""

    def __init__(self, prior: Callable[[int], float | None] | None = None) -> None:
        self.prior = prior
        self._buckets: dict[int, BucketState] = {}
        # [weighted squared residuals, weight] of the pairs' readings: two prior readings at MODEL_SPREAD
        self._noise = [2 * MODEL_SPREAD ** 2, 2.0]
        self._fit_prompt_seconds = 0.0  # request-seconds of prompt rows at the fit's price, the engine's life
        # per arm, the engine's life: [request-seconds its steps with prompt rows took beyond its
        # steps without, prompts they admitted, steps with prompt rows]
        self._admission = {False: [0.0, 0, 0], True: [0.0, 0, 0]}
        self._lengths = [0, 0]  # [tokens, requests]: finished requests' output lengths
        self._expected = [0, 0]  # [tokens, requests]: admitted requests' length limits (max_tokens)
        self._life = [0, 0]  # [committed tokens, admitted prompts], the engine's life

    @staticmethod
    def bucket(num_requests: int) -> int:
        """1 | 2 | 3-4 | 5-8 | 9-16 | ...: a load of up to n in flight stays in one bucket while its
        steps dip below n (between a finish and the admission that replaces it)."""
        return (max(1, num_requests) - 1).bit_length()

    def speculates(self, load: int) -> bool:
        """The arm the bucket of ``load`` runs now (a bucket met for the first time starts with
        speculation only where the model alone puts it ahead beyond the interval; where the model
        cannot tell yet, plain decoding until the first block ends at which it can)."""
        return self.state(load).running

    def observe(self, load: int, speculative: bool, committed: int | None, seconds: float, requests: int,
                prefill_seconds: float = 0.0, admitted: int = 0) -> None:
        """A step decided at ``load``: ``requests`` requests ran for ``seconds`` and committed
        ``committed`` tokens (None: a step that only admitted prompts); ``prefill_seconds`` of it
        were its prompt rows' (the cost fit's price), which began ``admitted`` prompts. A block's
        rate is that of its steps without prompt rows (of all its steps, their prompt rows at the
        fit's price taken out, where every step carried some), and every committed token is then
        charged its arm's admission price (``prompt_price``). Admitting prompts costs the two
        arms differently (speculation's requests finish at staggered steps, so it admits them one
        by one, each beside a speculative step), but which block a wave of prompts lands in is
        chance: counted as they come, one block in a few would read 2-3x slower than the rest. A
        step of the arm the bucket is not running (the switch between arms) and the first
        ``SETTLE_STEPS`` of a run count only as time."""
        if seconds <= 0 or requests <= 0:
            return
        self._fit_prompt_seconds += min(max(prefill_seconds, 0.0), seconds) * requests
        self._life[0] += committed or 0
        self._life[1] += admitted
        state = self.state(load)
        state.seconds += seconds
        state.block_seconds += seconds
        state.block_steps += 1
        if speculative != state.running:
            return
        admission = self._admission[speculative]
        admission[1] += admitted
        if prefill_seconds > 0:
            plain_step = state.decode_step[speculative]
            extra = seconds - plain_step if plain_step > 0 else min(prefill_seconds, seconds)
            admission[0] += max(extra, 0.0) * requests
            admission[2] += 1
        elif committed is not None:  # (a recent level: an average over about a block of steps)
            plain_step = state.decode_step[speculative]
            state.decode_step[speculative] = seconds if plain_step == 0 else plain_step + (seconds - plain_step) / BLOCK_STEPS
        if committed is None:
            return
        if state.settle > 0:
            state.settle -= 1
            return
        state.steps += 1
        if prefill_seconds > 0:  # (its decoding, at the fit's price of the rows: the fallback)
            state.mixed[0] += committed
            state.mixed[1] += max(seconds - prefill_seconds, 0.0) * requests
        else:
            state.tokens += committed
            state.request_seconds += seconds * requests
        if state.steps >= BLOCK_STEPS:
            self._end_block(state, load)

    def noise(self) -> float:
        """A pair's standard deviation in log rate ratio, as measured (pooled over every bucket)."""
        return math.sqrt(self._noise[0] / self._noise[1])

    def state(self, load: int) -> BucketState:
        """The bucket of ``load`` (created on first use, its first arm as ``speculates`` says)."""
        bucket = self.bucket(load)
        state = self._buckets.get(bucket)
        if state is None:  # (created once per bucket: the model's view is its first arm)
            prior = self.prior(load) if self.prior is not None else None
            first = self._model_leads(prior)
            state = self._buckets[bucket] = BucketState(in_force=first, running=first, started=first, prior=prior,
                                                       settle=BLOCK_STEPS)
        return state

    def finished(self, tokens: int) -> None:
        """A request left the engine after committing ``tokens`` tokens."""
        self._lengths[0] += tokens
        self._lengths[1] += 1

    def expect(self, max_tokens: int) -> None:
        """A request was admitted that may commit up to ``max_tokens`` tokens."""
        self._expected[0] += max_tokens
        self._expected[1] += 1

    def tokens_per_request(self) -> float:
        """The tokens a request commits in its life: the finished requests' mean, with the mean
        length limit of the admitted ones as one more observation (before any request finishes,
        that limit alone: the tokens committed so far per prompt would grow through a request's
        first life and charge the blocks measured first more than the later ones; without
        either, that ratio, a lower bound)."""
        tokens, requests = self._lengths
        if self._expected[1]:
            tokens, requests = tokens + self._expected[0] / self._expected[1], requests + 1
        elif not requests:
            tokens, requests = self._life
        return max(tokens / requests, 1.0) if requests else 1.0

    def admission_price(self, speculative: bool) -> float:
        """Request-seconds an arm's admission of one prompt costs the engine: what its steps with
        prompt rows took beyond its steps without, times their requests, per prompt they began
        (before the arm has ``OWN_PRICE_STEPS`` such steps, the cost fit's price of the rows, alike
        for both arms)."""
        extra, prompts, steps = self._admission[speculative]
        if steps >= OWN_PRICE_STEPS and prompts > 0:
            return extra / prompts
        prompts = self._life[1]
        return self._fit_prompt_seconds / prompts if prompts else 0.0

    def prompt_price(self, speculative: bool) -> float:
        """Request-seconds of prompt admission charged to each token an arm commits: its price
        of one prompt over the tokens a request commits."""
        return self.admission_price(speculative) / self.tokens_per_request()

    def _end_block(self, state: BucketState, load: int) -> None:
        per_token = self.prompt_price(state.running)
        tokens, request_seconds = (state.tokens, state.request_seconds) if state.tokens else state.mixed
        value = math.log(max(tokens, 1e-9) / (max(request_seconds, 1e-12) + tokens * per_token))
        state.arms[state.running].add(value, state.steps)
        for stats in (*state.arms.values(), state.pairs):
            stats.weight *= DISCOUNT
        if state.running != state.in_force:  # an explored block: its pair completes with the next block
            state.explored += 1
            # (an arm expected to be the better one earns back what it gains: its readings are cheap)
            if not self._free(state):
                state.explore_cost = max(0.0, state.explore_cost + state.block_seconds * self._expected_shortfall(state))
            state.pending = (state.running, value, state.before)
        else:
            if state.pending is not None:
                self._add_pair(state, value)
            state.before = value
        state.step_seconds = state.block_seconds / max(state.block_steps, 1)
        state.tokens = state.request_seconds = state.block_seconds = 0.0
        state.mixed = [0.0, 0.0]
        state.steps = state.block_steps = 0
        if self.prior is not None:
            told, state.prior = state.prior is not None, self.prior(load)
            if not told and state.prior is not None and not state.pairs.blocks and state.pending is None:
                # a bucket met before the model could tell ran plain as a placeholder, not a decision:
                # the model's arm is its first one
                state.in_force = state.started = self._model_leads(state.prior)
                state.before = None
        mean, sd = self._posterior(state)
        if abs(mean) > CONFIDENCE_Z * sd and (mean > 0) != state.in_force:
            state.in_force = mean > 0
            state.switches += 1
            state.pending, state.before = None, None  # (the neighbours now belong to the other arm)
        self._run(state, self._next_arm(state))

    @staticmethod
    def _free(state: BucketState) -> bool:
        """Whether the bucket's next exploration is one of its first ``FREE_PAIRS``, run whatever the
        budget: only where the model expects a lead of at least its own error, either way."""
        return state.pairs.blocks + (state.pending is not None) < FREE_PAIRS and state.prior is not None \
            and abs(state.prior) >= MODEL_SPREAD

    @staticmethod
    def _switches(state: BucketState) -> float:
        """What an exploration's way in and out costs: about a step each."""
        return 2 * state.step_seconds

    @staticmethod
    def _model_leads(prior: float | None) -> bool:
        """Whether the model alone puts speculation ahead beyond the interval (a bucket's first arm)."""
        return prior is not None and prior > CONFIDENCE_Z * MODEL_SPREAD

    def _add_pair(self, state: BucketState, after: float) -> None:
        """One reading of ``d``: the explored block against the mean of its in-force neighbours."""
        arm, explored, before = state.pending
        state.pending = None
        reference = after if before is None else (before + after) / 2
        reading = explored - reference if arm else reference - explored
        pairs = state.pairs
        if pairs.weight > 0:  # its scatter about the mean so far (that mean's own error taken out)
            residual = (reading - pairs.mean) ** 2 / (1 + 1 / pairs.weight)
            self._noise = [DISCOUNT * self._noise[0] + residual, DISCOUNT * self._noise[1] + 1.0]
        pairs.add(reading, 0)

    def _next_arm(self, state: BucketState) -> bool:
        other = not state.in_force
        if state.running == other:
            return state.in_force  # an exploration is one block, between two of the arm in force
        if self._free(state):
            return other  # a bucket's first readings where the model expects much at stake
        # (its way in and out is charged up front: a first exploration waits until the bucket can carry one)
        if not self._data_confirm(state) and \
                state.explore_cost + self._switches(state) <= EXPLORE_BUDGET * state.seconds:
            return other
        return state.in_force

    def _run(self, state: BucketState, arm: bool) -> None:
        if arm != state.running:
            first = state.arms[arm].blocks == 0
            if arm != state.in_force and not self._free(state):
                state.explore_cost += self._switches(state)
            # an arm's first run at a bucket meets new step shapes: a whole block settles
            state.running, state.settle = arm, BLOCK_STEPS if first else SETTLE_STEPS

    def _expected_shortfall(self, state: BucketState) -> float:
        """How far the arm not in force falls short of the one in force, as the posterior has it
        (negative: it is expected to be the faster one)."""
        mean, sd = self._posterior(state)
        if not math.isfinite(sd):
            return 0.0
        return 1.0 - math.exp(mean if state.in_force is False else -mean)

    def _data_variance(self, state: BucketState) -> float | None:
        return None if state.pairs.weight <= 0 else self.noise() ** 2 / state.pairs.weight

    def _data_confirm(self, state: BucketState) -> bool:
        """Whether the readings alone put the arm in force ahead, beyond their interval."""
        var = self._data_variance(state)
        lead = state.pairs.mean if state.in_force else -state.pairs.mean
        return var is not None and lead > CONFIDENCE_Z * math.sqrt(var)

    def _posterior(self, state: BucketState) -> tuple[float, float]:
        precision = total = 0.0
        if state.prior is not None:
            precision, total = 1 / MODEL_SPREAD ** 2, state.prior / MODEL_SPREAD ** 2
        var = self._data_variance(state)
        if var is not None:
            precision += 1 / var
            total += state.pairs.mean / var
        if precision == 0:
            return 0.0, math.inf
        return total / precision, precision ** -0.5

    def summary(self) -> dict:
        """Per bucket (by its largest load): each arm's measured rate, steps and blocks, the arm in
        force, the posterior ratio speculation / plain with its interval, the model's ratio."""
        out = {}
        for bucket, state in sorted(self._buckets.items()):
            arm = {True: "speculative", False: "plain"}
            entry = out[str(2 ** bucket)] = {"arm": arm[state.in_force], "started": arm[state.started],
                                             "switches": state.switches, "explored_blocks": state.explored,
                                             "pairs": state.pairs.blocks}
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
