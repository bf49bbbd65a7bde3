"""Load-adaptive speculation depth, engine-free: how many drafts each running request verifies in
the next engine step, and how deep every request drafts, from measured costs and acceptance.

Speculation pays only while extra query rows are cheap. A step runs `R` requests; request r
verifies `K_r` drafts (its last token plus `K_r` rows of the target), and the drafter then drafts
`D` tokens per request for the next step. The batch commits `sum_r E_r(K_r)` tokens in

    E_r(K)  = 1 + sum_{j=1..K} prod_{i=1..j} a_{r,i}      expected committed tokens at depth K
    t       = c_0 + c_req R + c_row rows + c_spec_req S
              + c_pass passes + c_draft_row draft_rows + c_draft_req draft_requests      (StepCost)

seconds, where `rows = R + sum K_r`, `S` = requests with `K_r > 0` (a multi-token query costs
more per request than a one-token decode), and the drafter's passes and rows follow from `D` and its
kind (`StepShape.of`: one pass of `R * D` rows for a parallel drafter, `D` passes for vLLM's
sequential draft model). `a_{r,i}` is request r's probability of accepting draft position i
given that every earlier one was accepted (AcceptanceTracker: per-request counts with a
population prior); the cost terms are fitted online from the engine's own step timings
(StepCostModel). `choose_depths` maximizes the batch's tokens per second exactly: for each `D`
the rate is a separable sum over a cost linear in `sum K_r`, which Dinkelbach's method solves
(for a guess `lam` of the best rate each request maximizes `E_r(K) - lam * a * K`; the rate rises
strictly until it stops changing; each request's own cost `c K + c_spec_req [K > 0]` is
separable too), and the best `D` wins.

Depth 0 is a plain decode step for that request. `allowed` restricts a request's choices (a gated
ProVe mode speculates a full window or nothing). Nothing here touches decoding results: lossless
modes stay exact under any schedule; only speed depends on the choice. `DepthController` wraps
it all into the per-step policy the engine calls (vllm_prove/engine/adaptive.py).
"""

from __future__ import annotations

import enum
import functools
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

RETRY_BUDGET = 0.05  # at most this share of a plain regime's time goes to retrying speculation ...
RETRY_LOSS_BUDGET = 0.01  # ... and at most this share of its throughput (a retry's time times speculation's shortfall)
MARGIN = 0.05  # a load that speculates goes on while speculation is realized faster than plain decoding by more than this ...
# ... and one that decodes plainly, or has no verdict yet, starts only where it leads by more than this:
# two rates read minutes apart on the CPU differ by 5-25% with no change of regime (an A/A test of
# three AR engines read 0.74-1.15x of each other run by run), so with one threshold both ways a
# load whose two rates are a few % apart switched with every reading (mode `sd` at 16 in flight:
# 0-81% plain by run, 0.94x AR where either regime alone realized ~1.0x)
ENTER_MARGIN = 0.15
CHUNK_DECAY = 0.98  # per step with prompt rows: a regime's price of a prompt row (a memory of ~50 such steps)
WORKLOAD_DECAY = 0.998  # per counted step: prompt rows per committed token (a memory of ~500 steps)
PLAIN_SETTLE_STEPS = 6  # plain steps right after speculative ones that no plain rate counts (they run slow)
# a few steps read a regime's rate only to within 10-15% on the CPU (the bench's `sd` engine read
# plain decoding at 32 in flight at 77.8 tokens per request-second from 7 steps, a standalone one
# at 87.4 from 469; the lossless and `sd` engines, the same target, read it at 8 at 131 and 155
# from 5-7 steps each), so two rates within 25% are a close call
REFRESH_WITHIN = 0.25  # a load's plain rate is measured afresh while speculation is ahead by less than this
CLOSE_WITHIN = 0.25  # a fresh measurement that finds the two rates this close goes on ...
CLOSE_STEPS = 32  # ... until this many of its steps are counted (a few steps are too noisy to call it)
PLAIN_REFIT_EVERY = 64  # steps between cost fits while the guard decodes plainly (it decides without them)
SUMMARY_EVERY = 16  # steps between refreshes of the estimates in DepthController.step_summary
MAX_DINKELBACH_ITERS = 50  # the rate converges in < 10 iterations in practice; this bounds a bug


def expected_committed(
    # [batch, max_depth] float: a_{r,i}, acceptance of position i given 1..i-1 accepted
    accept: torch.Tensor,
) -> torch.Tensor:  # [batch, max_depth + 1]: E_r(K) for K = 0..max_depth
    """``E(K) = 1 + sum_{j<=K} prod_{i<=j} a_i`` (the bonus / recovered token always commits)."""
    return torch.from_numpy(_expected_np(accept.double().numpy()))


def _expected_np(accept: np.ndarray) -> np.ndarray:  # [batch, max_depth] -> [batch, max_depth + 1]
    survive = np.cumprod(np.clip(accept, 0.0, 1.0), axis=-1)
    return 1.0 + np.concatenate([np.zeros((accept.shape[0], 1)), np.cumsum(survive, axis=-1)], axis=-1)


class DraftKind(str, enum.Enum):
    """How the drafter's work grows with the draft depth ``D`` of a step."""

    PARALLEL = "parallel"  # one pass of D rows per request (ProVe-lossless' mask pass); none at D = 0
    # vLLM's draft model: a pass over the step's rows, then D - 1 one-row passes; none at D = 0
    SEQUENTIAL = "sequential"


@dataclass(frozen=True)
class StepShape:
    """What an engine step computes: the target's query rows and the drafter's passes and rows,
    and how many requests read more than one query row (a multi-token query costs more per
    request than a one-token decode in some attention backends, vLLM's CPU one among them)."""

    requests: int
    rows: int  # target query rows: each request's last token plus its K_r drafts (plus prefill chunks)
    spec_requests: int  # requests verifying at least one draft
    draft_passes: int
    draft_rows: int
    draft_requests: int  # requests the drafter reads several rows of (its multi-token queries)
    # tokens drafted per request; not a cost term of its own (the passes and rows are), but what
    # tells a plain step (D = 0) from a drafting one
    draft_depth: int = field(default=0, compare=False)
    # rows of prompt chunks: counted in `rows` (no cost term of their own), but what tells the
    # throughput guard that a step carried a prompt chunk
    prefill_rows: int = field(default=0, compare=False)

    @staticmethod
    def of(requests: int, spec_tokens: int, draft_depth: int, kind: DraftKind, extra_rows: int = 0,
           spec_requests: int = 0) -> "StepShape":
        """The step that verifies ``spec_tokens`` drafts of ``spec_requests`` of its ``requests``
        requests and drafts ``draft_depth`` tokens for each (``extra_rows``: prefill tokens)."""
        rows = requests + spec_tokens + extra_rows
        if kind is DraftKind.PARALLEL:
            d = int(draft_depth > 0)
            return StepShape(requests, rows, spec_requests, d, requests * draft_depth, requests * d, draft_depth,
                             extra_rows)
        if draft_depth == 0:  # no draft pass (the engine's draft model catches its KV up when it next drafts)
            return StepShape(requests, rows, spec_requests, 0, 0, 0, 0, extra_rows)
        # vLLM's draft model: a pass over the step's rows (its own KV), then D - 1 one-row passes
        return StepShape(requests, rows, spec_requests, draft_depth, rows + requests * (draft_depth - 1), requests,
                         draft_depth, extra_rows)

    def features(self) -> np.ndarray:  # [7] float64, in COST_TERMS order
        return np.array([1.0, self.requests, self.rows, self.draft_passes, self.draft_rows, self.spec_requests,
                         self.draft_requests], dtype=np.float64)


COST_TERMS = ("c_0", "c_req", "c_row", "c_pass", "c_draft_row", "c_spec_req", "c_draft_req")


@dataclass
class StepCost:
    """``t = c_0 + c_req requests + c_row rows + c_pass draft_passes + c_draft_row draft_rows
    + c_spec_req spec_requests + c_draft_req draft_requests``."""

    c_0: float
    c_req: float
    c_row: float
    c_pass: float = 0.0
    c_draft_row: float = 0.0
    c_spec_req: float = 0.0
    c_draft_req: float = 0.0

    def __call__(self, shape: StepShape) -> float:
        return float(self.coefficients() @ shape.features())

    def coefficients(self) -> np.ndarray:  # [7] float64, in COST_TERMS order
        return np.array([getattr(self, name) for name in COST_TERMS])


def choose_depths(
    # [batch, max_depth + 1] float: E_r(K)
    expected: torch.Tensor,
    cost: StepCost,
    kind: DraftKind = DraftKind.PARALLEL,
    # [batch, max_depth + 1] bool or None: which depths request r may use (depth 0 always may)
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:  # ([batch] int64 K_r, draft depth D >= max K_r)
    """The verify depths ``K_r`` and the draft depth ``D`` that maximize
    ``sum_r E_r(K_r) / t(StepShape.of(R, sum K_r, D))``, exactly: for each ``D`` the rate is a
    ratio of a separable sum and a cost linear in ``sum K_r`` (Dinkelbach); the best ``D`` wins.
    Ties go to the shallower depth. Runs once per engine step, so it is numpy, vectorized over
    every ``D`` at once (~0.1 ms for 32 requests and B = 8)."""
    as_np = lambda x: x.numpy() if isinstance(x, torch.Tensor) else x  # noqa: E731
    E = np.asarray(as_np(expected), dtype=np.float64)
    batch, width = E.shape
    if batch == 0:
        return torch.zeros(0, dtype=torch.int64), 0
    ok = np.ones((batch, width), dtype=bool) if allowed is None else np.array(as_np(allowed), dtype=bool)
    ok[:, 0] = True
    depth = np.arange(width)
    ok = ok[None, :, :] & (depth[None, None, :] <= depth[:, None, None])  # [D, batch, K]: K <= D
    fixed, own = _step_costs(batch, width, kind, tuple(cost.coefficients().tolist()))
    rows = np.arange(batch)
    choice = np.zeros((width, batch), dtype=np.int64)  # [D, batch]: start from plain decoding
    rate = E[rows[None, :], choice].sum(axis=1) / (fixed + own[choice].sum(axis=1))
    for _ in range(MAX_DINKELBACH_ITERS):
        score = np.where(ok, E[None] - rate[:, None, None] * own[None, None, :], -np.inf)
        new = score.argmax(axis=-1)  # [D, batch]: the first (shortest) of the maxima
        new_rate = E[rows[None, :], new].sum(axis=1) / (fixed + own[new].sum(axis=1))
        improved = new_rate > rate + 1e-12
        if not improved.any():
            break
        choice[improved], rate[improved] = new[improved], new_rate[improved]
    best = int(np.flatnonzero(rate >= rate.max() - 1e-12)[0])  # the shallowest of the best D
    return torch.from_numpy(choice[best].copy()), best


@functools.lru_cache(maxsize=256)
def _step_costs(batch: int, width: int, kind: DraftKind, coefficients: tuple) -> tuple[np.ndarray, np.ndarray]:
    """``choose_depths``' two cost vectors: the cost of a step of ``batch`` requests with draft
    depth D and no verified draft ([width], by D), and what a request verifying K drafts adds to
    any step (its rows, its multi-token query; [width], by K): a step's cost is a sum of the two.
    Cached: the fit changes every few steps, the batch size rarely, and building the shapes is
    most of a solve's time (read-only arrays)."""
    cost = StepCost(*coefficients)
    fixed = np.array([cost(StepShape.of(batch, 0, d, kind)) for d in range(width)])
    # a request verifies K > 0 drafts only in a step that drafts (D >= K_r), where the sequential
    # draft model's first pass reads its verified rows too: the K-terms are measured at D = 1
    base = cost(StepShape.of(batch, 0, 1, kind))
    own = np.array([0.0] + [cost(StepShape.of(batch, k, 1, kind, spec_requests=1)) - base for k in range(1, width)])
    fixed.setflags(write=False)
    own.setflags(write=False)
    return fixed, own


@dataclass
class StepCostModel:
    """Online least squares of step seconds on ``StepShape.features()``, exponentially forgetting
    old steps (the load and the machine change); ``fit()`` gives the current StepCost.

    Coefficients are kept non-negative (a query row never makes a step cheaper): the fit is
    re-solved without the terms that come out negative. Terms the data cannot tell apart (at a
    steady load the request count never moves) share the time by least norm; the controller's
    exploration steps keep the terms it decides with identifiable."""

    forget: float = 0.98  # weight of the past per new step: an effective memory of ~50 steps
    _xtx: np.ndarray = field(default_factory=lambda: np.zeros((len(COST_TERMS), len(COST_TERMS))))
    _xty: np.ndarray = field(default_factory=lambda: np.zeros(len(COST_TERMS)))
    _pending: list = field(default_factory=list)  # (shape, seconds) observed since the last fit
    count: int = 0

    def update(self, shape: StepShape, seconds: float) -> None:
        if shape.rows < shape.requests or shape.requests < 0 or not 0 <= shape.spec_requests <= shape.requests \
                or min(shape.draft_passes, shape.draft_rows, shape.draft_requests) < 0 \
                or not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"a step needs rows >= requests >= 0, non-negative draft work and finite "
                             f"seconds >= 0, got {shape} in {seconds} s")
        self._pending.append((shape, seconds))  # summed in at the next fit (one numpy pass, not one per step)
        self.count += 1
        if len(self._pending) >= 64:  # (a plain regime decides without fitting)
            self._absorb()

    def _absorb(self) -> None:
        if not self._pending:
            return
        x = np.stack([shape.features() for shape, _ in self._pending])  # [n, terms]
        y = np.array([seconds for _, seconds in self._pending])
        w = self.forget ** np.arange(len(y) - 1, -1, -1)  # the newest step weighs 1
        self._xtx = self.forget ** len(y) * self._xtx + (x * w[:, None]).T @ x
        self._xty = self.forget ** len(y) * self._xty + (x * w[:, None]).T @ y
        self._pending.clear()

    def fit(self) -> StepCost:
        if self.count == 0:
            raise ValueError("no step measured yet: run the start-up probe first")
        self._absorb()
        active = list(range(len(COST_TERMS)))
        coef = np.zeros(0)
        while active:
            a = self._xtx[np.ix_(active, active)] + 1e-12 * np.eye(len(active))
            coef = np.linalg.lstsq(a, self._xty[active], rcond=None)[0]  # the least-norm solution
            negative = [active[i] for i, c in enumerate(coef.tolist()) if c < 0]
            if not negative:
                break
            active = [i for i in active if i not in negative]
        full = [0.0] * len(COST_TERMS)
        for i, c in zip(active, coef.tolist()):
            full[i] = max(c, 0.0)
        return StepCost(*full)


@dataclass
class AcceptanceTracker:
    """Per-request acceptance of each draft position, shrunk towards the population.

    ``a_{r,i} = (s_{r,i} + prior * p_i) / (n_{r,i} + prior)``: ``n`` = times position i was
    drafted with 1..i-1 accepted, ``s`` = times it was then accepted too; ``p_i`` is the same
    ratio over every request seen, position i shrunk towards position i - 1 (``population``)."""

    max_depth: int
    prior: float = 4.0  # pseudo-observations of the population a request starts with
    initial: float = 0.5  # the population's acceptance before anything is measured
    _pop_n: np.ndarray = field(init=False)
    _pop_s: np.ndarray = field(init=False)
    # per-request counts in one array (a numpy pass per engine step, not one per request): row 0
    # stays zero (a request never verified), a request's row is freed when it finishes
    _counts: np.ndarray = field(init=False)  # [rows, 2, max_depth]: n, s
    _slot: dict = field(default_factory=dict)  # request id -> its row
    _free: list = field(default_factory=list)
    _pop_cache: np.ndarray | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._pop_n, self._pop_s = np.zeros(self.max_depth), np.zeros(self.max_depth)
        self._counts = np.zeros((1, 2, self.max_depth))

    def record(self, request_id, num_draft_tokens: int, num_accepted: int) -> None:
        """One verification: positions 1..min(n, a+1) were reached; 1..a were accepted."""
        self.record_many([request_id], [num_draft_tokens], [num_accepted])

    def record_many(self, request_ids: list, num_draft_tokens: list[int], num_accepted: list[int]) -> None:
        """``record`` for a whole engine step at once (one numpy pass instead of one per request)."""
        drafted, accepted = np.asarray(num_draft_tokens), np.asarray(num_accepted)
        if len(request_ids) == 0:
            return
        if not ((0 <= accepted) & (accepted <= drafted) & (drafted <= self.max_depth)).all():
            raise ValueError(f"need 0 <= accepted <= drafted <= max_depth ({self.max_depth}), got "
                             f"{list(zip(num_draft_tokens, num_accepted))}")
        pos = np.arange(self.max_depth)
        seen = np.stack([pos[None, :] < np.minimum(drafted, accepted + 1)[:, None],  # reached
                         pos[None, :] < accepted[:, None]], axis=1).astype(np.float64)  # taken: [n, 2, W]
        rows = [self._row(r) for r in request_ids]  # (first: a new request may grow the array)
        if len(set(rows)) == len(rows):
            self._counts[rows] += seen
        else:
            np.add.at(self._counts, rows, seen)  # (a repeated id counts twice; ~10x slower)
        pooled = seen.sum(axis=0)
        self._pop_n += pooled[0]
        self._pop_s += pooled[1]
        self._pop_cache = None

    def _row(self, request_id) -> int:
        row = self._slot.get(request_id)
        if row is None:
            if not self._free:
                grown = len(self._counts)
                self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
                self._free = list(range(len(self._counts) - 1, grown - 1, -1))
            row = self._slot[request_id] = self._free.pop()
        return row

    def forget(self, request_id) -> None:
        """A finished request leaves (the population keeps what it taught)."""
        row = self._slot.pop(request_id, None)
        if row is not None:
            self._counts[row] = 0.0
            self._free.append(row)

    def population(self) -> torch.Tensor:  # [max_depth] float64
        """Pooled over every request; each position shrunk towards the one before it (the first
        towards `initial`) by `prior` pseudo-observations (a position drafted twice and rejected
        twice is not yet known to be worthless)."""
        return torch.from_numpy(self._population().copy())

    def _population(self) -> np.ndarray:
        if self._pop_cache is None:
            self._pop_cache = self._pool()
        return self._pop_cache

    def _pool(self) -> np.ndarray:
        # position i is shrunk towards position i - 1's estimate (position 1 towards `initial`):
        # a position rarely drafted is believed as good as the one before it, not as a coin flip,
        # so a drafter that is never tried deep is not kept shallow by a pessimistic prior
        out, before = np.empty(self.max_depth), self.initial
        for i in range(self.max_depth):
            before = out[i] = (self._pop_s[i] + self.prior * before) / (self._pop_n[i] + self.prior)
        return out

    def rates(self, request_ids: list) -> torch.Tensor:  # [batch, max_depth] float64
        return torch.from_numpy(self._rates(request_ids))

    def _rates(self, request_ids: list) -> np.ndarray:
        if not request_ids:
            return np.zeros((0, self.max_depth))
        counts = self._counts[[self._slot.get(r, 0) for r in request_ids]]  # [batch, 2, W]
        return (counts[:, 1] + self.prior * self._population()) / (counts[:, 0] + self.prior)


class ThroughputGuard:
    """A model-free check on the fitted policy: per load (requests a step runs, in buckets of up
    to 1, 2, 4, 8, ...), the committed tokens per request-second the engine *realized* in its
    plain regime and in its speculative regime (exponentially weighted sums of tokens and of
    seconds times requests: per request, so that steps at 9 and at 15 running requests compare
    fairly). The speculative regime's steps that only draft or only verify are part of what
    speculating costs; prompt rows are priced per regime over the long run (`_rate_at`); which
    steps count is `DepthController.observe_step`'s choice. Plain decoding is measured in blocks (`plain_block`).
    Unless speculation has been faster by more than `margin` (`prefers_plain`: a tie, or a lower
    load's verdict where this one measured only one regime, goes to plain decoding), `plain_wins`
    tells the controller to decode plainly, but for a *retry* now and then: the speculative estimate of the
    load is forgotten and speculation runs until `min_steps` steps have measured it afresh (a
    stale estimate, or one left by a few unlucky steps, must not outvote the present), then the
    two rates compare again; where they come within `CLOSE_WITHIN` of each other the retry goes
    on to `CLOSE_STEPS` steps (`_settled`: on a 2-CPU machine retries of 4-8 steps read mode
    `sd`'s speculation at 16 in flight at 67-97 tokens per request-second against plain
    decoding's 95-104, where vLLM's fixed-depth SD realized 1.09x AR).

    A retry is due after `retry_every` plain decisions *and* once the plain regime has run
    `1 / retry_budget - 1` times as long as the last retry took, so retries take at most
    `retry_budget` of the time wherever plain decoding wins; and where the last retry found
    speculation short of plain decoding by a share `s`, once it has run `s / retry_loss_budget`
    times as long, so retries give up at most `retry_loss_budget` of the throughput. At a high load a speculative step
    costs several plain ones and so does a retry: there they are rare. Where they are cheap they
    come often, so a change of load or of the machine is noticed soon. A retry that puts
    speculation ahead ends the plain regime. A cost model that misjudges the engine (a per-step
    cost it has no term for) thus cannot keep a load slower than plain decoding for long, nor a
    bad first impression keep it from speculating."""

    def __init__(self, decay: float = 0.95, margin: float = MARGIN, min_steps: int = 4, retry_every: int = 32,
                 retry_budget: float = RETRY_BUDGET, retry_loss_budget: float = RETRY_LOSS_BUDGET,
                 enter_margin: float | None = None) -> None:
        if not 0 < retry_budget < 1:
            raise ValueError(f"retry_budget must be in (0, 1), got {retry_budget}")
        enter_margin = max(ENTER_MARGIN, margin) if enter_margin is None else enter_margin
        if not 0 <= margin <= enter_margin:
            raise ValueError(f"need 0 <= margin <= enter_margin, got {margin} and {enter_margin}")
        self.decay, self.margin, self.enter_margin, self.min_steps = decay, margin, enter_margin, min_steps
        if not 0 < retry_loss_budget < 1:
            raise ValueError(f"retry_loss_budget must be in (0, 1), got {retry_loss_budget}")
        self.retry_every, self.retry_budget, self.retry_loss_budget = retry_every, retry_budget, retry_loss_budget
        # (bucket, speculative) -> [tokens, request-seconds, steps, seconds] of decoding (prompt chunks out)
        self._sums: dict[tuple[int, bool], list[float]] = {}
        self._steady: dict[tuple[int, bool], float] = {}  # (bucket, speculative) -> a step's seconds without prompts
        # (bucket, speculative) -> [seconds, rows]: what its steps' prompt rows cost beyond a steady step
        self._chunks: dict[tuple[int, bool], list[float]] = {}
        self._workload = [0.0, 0.0]  # [prompt rows, committed tokens]: what each token brings in prompt rows
        self._forced: Counter = Counter()  # bucket -> plain decisions since its last retry
        self._plain_seconds: Counter = Counter()  # bucket -> seconds of plain steps since its last retry
        self._retry_seconds: Counter = Counter()  # bucket -> seconds its last (or current) retry took
        self._spec_step_seconds: dict[int, float] = {}  # bucket -> a speculative step's seconds (running mean)
        self._retrying: set[int] = set()  # buckets measuring speculation afresh
        self._retries: Counter = Counter()  # bucket -> retries so far
        self._shortfall: dict[int, float] = {}  # bucket -> 1 - speculative / plain rate when its last retry ended
        self._verdicts: dict[int, bool] = {}  # bucket -> plain preferred when both rates were last measured
        self._plain_block: set[int] = set()  # buckets measuring plain decoding afresh
        self._block_seconds: Counter = Counter()  # bucket -> seconds its last (or current) plain block took
        self._spec_decisions: Counter = Counter()  # bucket -> speculative decisions since its last plain block
        self._spec_seconds: Counter = Counter()  # bucket -> seconds of speculative steps since its last plain block
        # load -> a speculative step's predicted seconds, for a load with none measured (the controller's cost fit)
        self.spec_step_prior: Callable[[int], float] | None = None
        # (kind, bucket) -> what follows from the rates alone (a bucket's measured verdict, the lower
        # buckets' one); emptied whenever a rate changes. A step asks several times over all buckets
        # below its own, ~60 calls that took ~0.03 ms of the engine core's step at 32 in flight
        self._memo: dict = {}

    @staticmethod
    def bucket(num_requests: int) -> int:
        """1 | 2 | 3-4 | 5-8 | 9-16 | ...: a load of up to n in flight stays in one bucket while its
        steps dip below n (between a finish and the admission that replaces it); with buckets
        that start at a power of two (8-15 | 16-31) 16 in flight straddled two of them, and its
        steps at 13 were measured with those of 8 in flight."""
        return (max(1, num_requests) - 1).bit_length()

    def observe(self, num_requests: int, speculative: bool, committed: int, seconds: float,
                counted: bool = True, load: int | None = None, prefill_rows: int = 0,
                prefill_seconds: float = 0.0) -> None:
        """A step of `num_requests` requests that committed `committed` tokens (0: a step that only
        admits prompts): its time always counts towards the retry budget; if `counted`, its rate
        and its `prefill_rows` (prompt rows): a step with prompt rows decodes in the regime's
        steady step time (or in `seconds - prefill_seconds`, the cost fit's price of the rows,
        before any), and the rest is its prompt rows' price (``_rate_at``).
        `load`: the load it was decided at, whose bucket it feeds (default `num_requests`)."""
        if seconds <= 0 or num_requests <= 0:
            return
        bucket = self.bucket(load or num_requests)
        if bucket in self._retrying:
            self._retry_seconds[bucket] += seconds
        elif bucket in self._plain_block:
            self._block_seconds[bucket] += seconds
        elif speculative:
            self._spec_seconds[bucket] += seconds
        else:
            self._plain_seconds[bucket] += seconds
        if speculative and counted:  # (the retry budget's unit: a whole step, prompt chunks and all)
            last = self._spec_step_seconds.get(bucket, seconds)
            self._spec_step_seconds[bucket] = self.decay * last + (1 - self.decay) * seconds
        if not counted:
            return
        self._memo.clear()
        key = (bucket, speculative)
        workload = self._workload
        workload[0] = WORKLOAD_DECAY * workload[0] + prefill_rows
        workload[1] = WORKLOAD_DECAY * workload[1] + committed
        steady = self._steady.get(key)
        if not prefill_rows:
            decoding = seconds
            self._steady[key] = seconds if steady is None else self.decay * steady + (1 - self.decay) * seconds
        else:
            decoding = 0.0 if not committed else min(seconds, steady if steady is not None else seconds - prefill_seconds)
            chunks = self._chunks.setdefault(key, [0.0, 0.0])
            chunks[0] = CHUNK_DECAY * chunks[0] + (seconds - decoding)
            chunks[1] = CHUNK_DECAY * chunks[1] + prefill_rows
        if decoding <= 0:
            return
        sums = self._sums.setdefault(key, [0.0, 0.0, 0, 0.0])
        sums[0] = self.decay * sums[0] + committed
        sums[1] = self.decay * sums[1] + decoding * num_requests
        sums[2] += 1
        sums[3] = self.decay * sums[3] + decoding

    def rate(self, num_requests: int, speculative: bool) -> float | None:
        """Realized committed tokens per request-second at this load, or None before `min_steps`
        steps."""
        return self._rate_at(self.bucket(num_requests), speculative)

    def _rate_at(self, bucket: int, speculative: bool) -> float | None:
        """Committed tokens per request-second of decoding, with the prompt rows its tokens bring
        (``_workload``: the same for both regimes, a property of the traffic) at the regime's own
        price of a prompt row (the other regime's before it has one): a plain regime admits a
        finished wave's prompts together, speculation one by one, each in a step that carries the
        whole batch's drafts. Which steps carry prompts is partly chance, so a regime's rate
        takes their cost out and each token pays the long-run average back."""
        sums = self._sums.get((bucket, speculative))
        if sums is None or sums[2] < self.min_steps:
            return None
        tokens, request_seconds, _, seconds = sums
        chunks = self._chunks.get((bucket, speculative)) or self._chunks.get((bucket, not speculative))
        rows, committed = self._workload
        if not chunks or not chunks[1] or not committed:
            return tokens / request_seconds
        per_token = rows / committed * chunks[0] / chunks[1] * request_seconds / seconds  # request-seconds
        return tokens / (request_seconds + tokens * per_token)

    def _lead(self, bucket: int, speculative: bool, margin: float) -> bool | None:
        """Whether `speculative`'s rate at the bucket is the faster by more than `margin` (None:
        not both measured)."""
        mine, other = self._rate_at(bucket, speculative), self._rate_at(bucket, not speculative)
        return None if mine is None or other is None else mine > other * (1 + margin)

    def _margin(self, bucket: int) -> float:
        """The lead speculation needs at the bucket: `margin` to go on speculating where its last
        verdict was speculation, `enter_margin` to start where it was plain decoding or there is
        none yet (hysteresis: a reading within the band between them changes nothing)."""
        return self.margin if self._verdicts.get(bucket) is False else self.enter_margin

    def _measured_plain_preferred(self, bucket: int) -> bool | None:
        """Whether the bucket's own rates prefer plain decoding (None: not both measured)."""
        key = ("own", bucket)
        if key not in self._memo:
            lead = self._lead(bucket, speculative=True, margin=self._margin(bucket))
            if lead is not None:
                self._verdicts[bucket] = not lead
            self._memo[key] = None if lead is None else not lead
        return self._memo[key]

    def _verdict(self, bucket: int) -> bool:
        """Whether the bucket's rates prefer plain decoding, or did when both were last measured:
        what a higher load infers from it. While the bucket retries (one regime's rate forgotten,
        measured afresh) its last verdict stands: at 32 in flight in mode `sd` the retries of the
        9-16 bucket, which a run's last requests pass through, left 17-32 to the cost fit, which
        speculated there at 0.62x plain decoding's rate."""
        own = self._measured_plain_preferred(bucket)
        return self._verdicts.get(bucket, False) if own is None else own

    def knows(self, num_requests: int, speculative: bool) -> bool:
        """Whether this load has `min_steps` decode steps of the kind measured."""
        return self.rate(num_requests, speculative) is not None

    def plain_faster(self, num_requests: int) -> bool:
        """Whether plain decoding has been faster at this load (by more than `margin`)."""
        return self._ahead(num_requests, speculative=False)

    def prefers_plain(self, num_requests: int) -> bool:
        """Whether this load decodes plainly: both regimes are measured and speculation is not the
        faster by more than the bucket's margin (`margin` where it speculates, `enter_margin` where
        it decodes plainly or has no verdict yet; a tie goes to plain decoding: what speculating costs beyond
        its own steps, requests finishing out of step so that prompts are admitted one by one and
        never again as a wave, falls on its side); or, where this load has not measured both, a
        lower load prefers plain decoding by its own measurements: the more requests a step
        runs, the dearer its extra query rows, so plain decoding that wins at 16 in flight wins
        at 32 (and the lower load's retries keep testing it; while one runs, the lower load's last
        verdict stands). Never during a retry of this load (it speculates until measured)."""
        if self.bucket(num_requests) in self._retrying:
            return False
        bucket = self.bucket(num_requests)
        own = self._measured_plain_preferred(bucket)
        if own is not None:
            return own
        key = ("below", bucket)
        if key not in self._memo:
            self._memo[key] = any(self._verdict(b) for b in range(bucket))
        return self._memo[key]

    def plain_block(self, num_requests: int) -> bool:
        """Whether this load should decode plainly now to measure plain decoding afresh: where its
        plain rate is unknown, and while it speculates less than `REFRESH_WITHIN` ahead of it,
        once the speculative regime has run `1 / retry_budget - 1` times as long as the last
        block took (and `retry_every` decisions; at a low load a plain step costs the gap to a
        speculative one and a switch, so where speculation is far ahead no block is worth it). A
        block runs until `min_steps` of its plain steps are counted (`CLOSE_STEPS` in a close
        call, `_settled`; its first `PLAIN_SETTLE_STEPS`, right after speculative steps, run slow
        and are not: `DepthController.observe_step`), so the rate speculation is compared with is
        neither stale nor that of isolated steps amid speculation."""
        bucket = self.bucket(num_requests)
        if bucket in self._plain_block:
            if not self._settled(bucket, speculative=False):
                return True
            self._plain_block.discard(bucket)
            self._spec_decisions[bucket], self._spec_seconds[bucket] = 0, 0.0
            return False
        if bucket in self._retrying or self.prefers_plain(num_requests):
            return False  # (a plain regime measures plain decoding all the time)
        if self._lead(bucket, speculative=True, margin=REFRESH_WITHIN):
            return False  # far ahead: a few % of bias in the plain rate cannot change the decision
        plain = self._sums.get((bucket, False))
        if plain is not None and plain[2] < CLOSE_STEPS and self.knows(num_requests, speculative=True):
            # measured in fewer steps than a close call takes (a load's first block ends at
            # `min_steps`: nothing to compare with yet), and speculation came out close: the
            # block goes on, its steps so far kept, until the call is `_settled`
            self._plain_block.add(bucket)
            self._block_seconds[bucket] = 0.0
            return True
        if self.knows(num_requests, speculative=False):
            self._spec_decisions[bucket] += 1
            wait = self._block_seconds[bucket] * (1 / self.retry_budget - 1)
            if self._spec_decisions[bucket] <= self.retry_every or self._spec_seconds[bucket] < wait:
                return False
            self._sums.pop((bucket, False), None)  # forget plain decoding's rate, measure it again
            self._memo.clear()
        self._plain_block.add(bucket)
        self._block_seconds[bucket] = 0.0
        return True

    def _settled(self, bucket: int, speculative: bool) -> bool:
        """Whether a fresh measurement of `speculative`'s rate at the bucket may end: `min_steps`
        counted, and `CLOSE_STEPS` where the two rates are within `CLOSE_WITHIN` of each other
        (a close call is decided on more steps; a clear one ends as soon as it is measured)."""
        mine = self._sums.get((bucket, speculative))
        if mine is None or mine[2] < self.min_steps:
            return False
        # (both rates as the decision compares them, prompt rows priced)
        rate, other = self._rate_at(bucket, speculative), self._rate_at(bucket, not speculative)
        close = other is not None and abs(rate / other - 1) < CLOSE_WITHIN
        return not close or mine[2] >= CLOSE_STEPS

    def measuring_plain(self, num_requests: int) -> bool:
        """Whether this load is in a plain block (measuring plain decoding afresh)."""
        return self.bucket(num_requests) in self._plain_block

    def speculation_faster(self, num_requests: int) -> bool:
        """Whether speculative steps have been faster at this load (by more than the bucket's margin)."""
        return self._ahead(num_requests, speculative=True)

    def _ahead(self, num_requests: int, speculative: bool) -> bool:
        """Whether both regimes are measured at this load and `speculative`'s is the faster by
        more than the margin (speculation: the bucket's, ``_margin``)."""
        bucket = self.bucket(num_requests)
        return bool(self._lead(bucket, speculative, self._margin(bucket) if speculative else self.margin))

    def retrying(self, num_requests: int) -> bool:
        """Whether this load is measuring speculation afresh (a retry: the controller speculates)."""
        return self.bucket(num_requests) in self._retrying

    def plain_wins(self, num_requests: int) -> bool:
        """Whether this load should decode plainly now (False during a retry)."""
        bucket = self.bucket(num_requests)
        if bucket in self._retrying:
            if not self._settled(bucket, speculative=True):
                return False  # the retry goes on until speculation is measured afresh
            self._retrying.discard(bucket)
            if self.prefers_plain(num_requests):  # plain still ahead: back to plain, the budget restarts
                self._forced[bucket], self._plain_seconds[bucket] = 1, 0.0
                spec, plain = self._rate_at(bucket, True), self._rate_at(bucket, False)
                self._shortfall[bucket] = min(1.0, max(0.0, 1 - spec / plain)) if spec and plain else 0.0
                return True
        if not self.prefers_plain(num_requests):
            self._forced[bucket], self._plain_seconds[bucket] = 0, 0.0
            return False
        if self._measured_plain_preferred(bucket) is None:
            return True  # plain by a lower load's measurements, whose retries test it
        self._forced[bucket] += 1
        # the last retry's time, or before the first one what `min_steps` speculative steps cost
        # (measured at this load, else as `spec_step_prior` predicts: a load first met in a plain
        # regime would otherwise retry at once, at 32 in flight ~5 steps of 4 plain ones' cost)
        step = self._spec_step_seconds.get(bucket)
        if step is None and self.spec_step_prior is not None:
            step = self.spec_step_prior(num_requests)
        expected = max(self._retry_seconds[bucket], self.min_steps * (step or 0.0))
        # its time's share of the plain regime's, and the throughput it gives up (where the last
        # retry found speculation far behind, e.g. lossless at 32 in flight at ~0.63x, a retry every
        # 19 of its lengths cost ~2% of the regime's throughput; now ~1%)
        wait = expected * max(1 / self.retry_budget - 1, self._shortfall.get(bucket, 0.0) / self.retry_loss_budget)
        if self._forced[bucket] <= self.retry_every or self._plain_seconds[bucket] < wait:
            return True
        self._retries[bucket] += 1
        self.measure_speculation(num_requests)  # a retry: forget speculation's rate, measure it again
        return False

    def measure_speculation(self, num_requests: int) -> None:
        """Measure speculation at this load afresh (its rate forgotten; the controller speculates,
        at the full depth where the fit says plain, until `_settled`): a retry, and a load's first
        measurement, which then ends as a retry does (`plain_wins`)."""
        bucket = self.bucket(num_requests)
        self._sums.pop((bucket, True), None)
        self._memo.clear()
        self._retrying.add(bucket)
        self._retry_seconds[bucket] = 0.0

    def summary(self) -> dict:
        out = {}
        for (bucket, speculative), (tokens, seconds, steps, _) in sorted(self._sums.items()):
            entry = out.setdefault(str(2 ** bucket), {})  # a bucket by its largest load
            rate = self._rate_at(bucket, speculative) or tokens / seconds  # (before min_steps: decoding alone)
            entry["speculative" if speculative else "plain"] = {"tok_per_req_s": round(rate, 1),
                                                                "steps": steps}
            if self._retries[bucket]:
                entry["retries"] = self._retries[bucket]
                entry["retry_ms"] = round(1000 * self._retry_seconds[bucket], 1)  # the last one's time
        return out


@dataclass
class Decision:
    """One step's plan: each request's verify depth ``K_r`` (at most the drafts it holds) and the
    depth ``D`` every request drafts for the next step."""

    depths: dict
    draft_depth: int
    explored: bool
    load: int = 0  # the load it judged (what the step's observation names: ``observe_step(load=...)``)


class DepthController:
    """The per-step policy: measured costs and acceptance -> ``choose_depths``.

    The first decisions with running requests cycle through the draft depths twice (every
    request verifying all it holds), so the cost fit has seen cheap and dear steps before it
    decides anything (the start-up probe). Afterwards one step in ``explore_every`` tries a
    neighbouring draft depth (plain decoding is the throughput guard's to measure, in blocks), so
    the fit keeps seeing more than the one step shape it would otherwise choose forever, at the
    price of one slightly-off step in 32.
    The fit, and with it the choice for an unchanged set of requests, is refreshed every
    ``refit_every`` steps (one engine step must not wait for either).
    ``policy="random"`` draws every depth at random (the exactness tests' schedule driver);
    ``policy="plain"`` decodes plainly every step (a diagnostic: the engine's cost without drafts).
    ``allowed`` restricts the depths (a window-or-none mode: ``allowed=(B,)``)."""

    def __init__(self, max_depth: int, kind: DraftKind, policy: str = "measured", allowed: tuple[int, ...] | None = None,
                 explore_every: int = 32, refit_every: int = 8, seed: int = 0) -> None:
        if policy not in ("measured", "random", "plain"):
            raise ValueError(f"policy must be 'measured', 'random' or 'plain', got {policy!r}")
        self.max_depth, self.kind, self.policy = max_depth, DraftKind(kind), policy
        self.choices = sorted({0, *(allowed if allowed is not None else range(max_depth + 1))})
        if self.choices[-1] > max_depth:
            raise ValueError(f"allowed depths {self.choices} exceed max_depth {max_depth}")
        self._allowed_row = np.zeros(max_depth + 1, dtype=bool)
        self._allowed_row[self.choices] = True
        # probe order: deepest, none, then the rest from deep to shallow, twice
        self.probe = ([self.choices[-1], 0] + [d for d in reversed(self.choices) if d not in (0, self.choices[-1])]) * 2
        self.explore_every, self.refit_every = explore_every, refit_every
        self.tracker = AcceptanceTracker(max_depth=max(max_depth, 1))
        self.costs = StepCostModel()
        self.guard = ThroughputGuard()
        self.guard.spec_step_prior = self._predicted_spec_step
        self.steps = 0
        self.depth_counts: Counter = Counter()  # K_r over every (request, step) decided
        self.draft_depth_counts: Counter = Counter()
        self.last_cost: StepCost | None = None  # the fit the measured decisions use
        self._last_draft_depth = self.choices[-1]
        self._observed_draft_depth = 0  # the draft depth of the last step observed
        self._first_steps: Counter = Counter()  # guard bucket -> speculative steps observed there
        self._cached: tuple = (((), False), {}, 0)  # ((ids, guard speculates), depths, D) of the last solve
        self._rng = random.Random(seed)
        self._estimates: tuple[int, dict] | None = None  # (steps, estimates) of step_summary
        self._fit_step = 0  # the step of the last fit
        self._fresh: dict = {}  # (load, fit, guard speculates) -> a prefill-only step's draft depth
        self._decoding_load = 0  # the load of the last decision with decoding requests
        self._plain_run = PLAIN_SETTLE_STEPS  # plain steps observed since the last speculative one (settled)

    def decide(self, request_ids: list, pinned=frozenset(), load: int | None = None) -> Decision:
        """Depths for the decoding ``request_ids``. ``load``: the requests the step will run
        (default: the decoding ones), the load the throughput guard judges, and the one the step's
        observation should name (``observe_step(load=...)``): at a steady 16 in flight the step
        after a request finishes decodes 15 and admits the 16th; judged by its decoding requests
        the decision could flip between regimes with every finish, each switch costing a draft
        pass whose drafts the next step drops. While any ``pinned`` request runs (decoding or
        not) the whole batch takes the full depth, as with a fixed depth: a seeded request that
        samples consumes its generator per draft, and vLLM's sampling of a batch is only
        reproducible request by request when every step has the same shape, so its text must not
        depend on the load. A step that only admits prompts is judged at no less than the last
        decoding step's load (``Decision.load``): between two waves of requests the next wave's
        first prompt can arrive alone (at 16 in flight a lossless engine's plain regime drafted 8
        tokens in such a step, judged at 1, for a step at 16 that dropped them: +5 ms a wave); a
        request that arrives at an engine idle after a higher load decodes one step plainly."""
        load = max(load or 0, len(request_ids))
        if request_ids:
            self._decoding_load = load
        else:
            load = max(load, self._decoding_load)
        decision = self._decide(request_ids, load)
        if pinned:
            full = self.choices[-1]
            decision = Decision({r: full for r in decision.depths}, full, decision.explored)
        decision.load = load
        return self._record(decision) if request_ids else decision

    def _decide(self, request_ids: list, load: int) -> Decision:
        if not request_ids:  # a prefill-only step: its requests draft for the next one, at `load`
            depth = {"measured": self._fresh_draft_depth(load), "plain": 0}.get(self.policy, self.choices[-1])
            return Decision({}, depth, False)
        step, self.steps = self.steps, self.steps + 1
        if self.policy == "plain":
            return Decision(dict.fromkeys(request_ids, 0), 0, False)
        if self.policy == "random":
            d = self._rng.choice(self.choices)
            return Decision({r: self._rng.choice([k for k in self.choices if k <= d]) for r in request_ids}, d, True)
        if step < len(self.probe) or self.costs.count == 0:
            d = self.probe[step % len(self.probe)]
            return Decision({r: d for r in request_ids}, d, True)
        if self.guard.plain_block(load):  # the guard measures plain decoding here (afresh)
            self._refit(step, PLAIN_REFIT_EVERY)
            return Decision(dict.fromkeys(request_ids, 0), 0, True)
        if step % self.explore_every == 0 and not self.guard.prefers_plain(load) \
                and not self.guard.retrying(load):
            # (where plain decoding has been faster, the guard's retries explore instead)
            i = self.choices.index(self._last_draft_depth)
            # (plain decoding is the guard's to measure, in blocks: a lone plain step would cost a
            # step that drafts with nothing to verify after it)
            near = {self.choices[max(i - 1, 0)], self.choices[min(i + 1, len(self.choices) - 1)]} - {0}
            if near - {self._last_draft_depth}:
                d = self._rng.choice(sorted(near - {self._last_draft_depth}))
                return Decision({r: d for r in request_ids}, d, True)
        if not self.guard.knows(load, speculative=True) and not self.guard.prefers_plain(load) \
                and not self.guard.retrying(load):
            self.guard.measure_speculation(load)  # (plain decoding measured: speculation's turn)
        if self.guard.plain_wins(load):  # realized: plain decoding is faster here (no solve)
            self._last_draft_depth = 0  # the plan in force is plain (explorations, a prefill-only step)
            self._refit(step, PLAIN_REFIT_EVERY)
            return Decision(dict.fromkeys(request_ids, 0), 0, False)
        # (the fit's plan speculates: where it would decode plainly the guard speculates,
        # ``_guard_speculates``, or has decided plain decoding above)
        self._solve_cached(request_ids, load, self._refit(step, self.refit_every))
        _, depths, d = self._cached
        self._last_draft_depth = d
        return Decision(dict(depths), d, False)

    def _solve_cached(self, request_ids: list, load: int, refit: bool) -> None:
        """The solver's plan for ``request_ids`` at ``load`` into ``_cached``: solved again after a
        new fit or for other requests; else the same requests keep their depths until the next fit
        (acceptance moves slowly; a step must not wait ~0.1 ms for it)."""
        speculate = self._guard_speculates(load)
        key = (tuple(request_ids), speculate)
        if refit or key != self._cached[0]:
            depths, d = self._solve(self.tracker._rates(request_ids), speculate)
            self._cached = (key, dict(zip(request_ids, depths.tolist())), d)

    def prepare(self, request_ids: list, load: int) -> None:
        """The fit and the solve the next decision would make for ``request_ids`` at ``load``, made
        ahead: an engine calls this while its workers run a step (the engine core would poll
        meanwhile), so the next ``decide`` finds both done. Only where the next decision is the
        solver's (the guard neither decodes the load plainly nor measures it in a block) and a fit
        or a solve is due; the guard's state is read, never advanced. A decision that differs (a
        request finished or was admitted, the guard moved) solves for itself, as without it."""
        if self.policy != "measured" or not request_ids or self.last_cost is None or self.steps < len(self.probe):
            return
        if self.guard.prefers_plain(load) or self.guard.measuring_plain(load):
            return
        step = self.steps  # (the next decision's index)
        if step % self.explore_every == 0:
            return  # (it may explore: ``_decide``, which then fits a step later)
        fresh = step - self._fit_step >= self.refit_every
        if fresh:
            self.last_cost, self._fit_step = self.costs.fit(), step
        self._solve_cached(request_ids, load, fresh)

    def _guard_speculates(self, load: int) -> bool:
        """Whether the guard has this load speculate whatever the fit says: a retry measures
        speculation (left to the solver, it could decide depth 0 for the whole retry, which then
        never ends: steps that decode plainly do not measure speculation), the engine realized
        speculation faster here (a cost the fit has no term for), or speculation has no realized
        rate here yet. A plan the fit makes plain is checked like any other: a fit misled by the
        slow first passes of new shapes (the start-up probe's; on a GPU, kernels compiled for
        them) would otherwise decode such a load plainly for good, since nothing measures
        speculation where nobody speculates (an in-process engine at 1 in flight in mode `sd`
        fitted a draft-model request at 4.5 ms a step from its probe and decoded plainly at 0.73x
        of the full depth's rate; the bench's `sd` engine at 8 in flight, met after 4, decoded
        plainly where vLLM's fixed depth realized 1.22x AR). Where a lower load's measured
        verdict is plain decoding (``ThroughputGuard.prefers_plain``) the guard decides first."""
        guard = self.guard
        return guard.retrying(load) or guard.speculation_faster(load) or not guard.knows(load, speculative=True)

    def _solve(self, rates: np.ndarray, speculate: bool) -> tuple[torch.Tensor, int]:
        """``choose_depths`` for requests with acceptance ``rates`` ([batch, >= max_depth]) under
        the fit in use. Where the fit says plain but the guard speculates (``speculate``,
        ``_guard_speculates``), every request takes the full depth, the fixed-depth plan:
        the guard checks a fit that misjudges speculating, so it must not take the depths from
        that fit (mode `sd` at 8 in flight: a fit that priced a draft-model request at 2.3 ms a
        step retried at depth 1, read 0.9x plain decoding, and decoded plainly where vLLM's fixed
        depth 5 realized 1.05-1.09x AR). Where the fit speculates, its plan runs (and is what a
        retry measures). Without ``speculate`` (the guard has measured speculation here and
        decides plain decoding itself) the fit's plain plan stands: a step that only admits
        prompts then drafts nothing (``_fresh_draft_depth``)."""
        expected = _expected_np(rates[:, : self.max_depth])
        allowed = np.broadcast_to(self._allowed_row, (len(expected), self.max_depth + 1))
        depths, d = choose_depths(expected, self.last_cost, self.kind, allowed)
        if d == 0 and speculate:
            full = self.choices[-1]
            return torch.full((len(expected),), full, dtype=torch.int64), full
        return depths, d

    def _refit(self, step: int, every: int) -> bool:
        """Fit the step costs afresh if the fit in use is ``every`` steps old (or there is none).
        Decisions the guard takes without a solve need the fit only to price their steps' prompt
        chunks and a retry's steps, so there a fit is made ``PLAIN_REFIT_EVERY`` steps apart:
        in the engine a fit takes ~0.4 ms of the scheduler's time, 0.05 ms a step at 8 apart
        (0.8% of a plain step at 32 in flight on the CPU), and a new fit means a new solve."""
        if self.last_cost is not None and step - self._fit_step < every:
            return False
        self.last_cost, self._fit_step = self.costs.fit(), step
        return True

    def _fresh_draft_depth(self, load: int) -> int:
        """The draft depth of a step that only admits prompts: what the next step, ``load`` requests
        new to the acceptance estimates, is planned to verify. Not the depth last in force, which a
        lower load may have left (a run's last requests speculating): at 32 in flight an engine
        whose first wave of prompts drafted 8 tokens each, for a next step that decoded plainly
        and dropped them, spent 17 ms a wave on a pass a plain step does not need (0.88x AR)."""
        if self.costs.count == 0 or self.last_cost is None or load < 1:
            return self._last_draft_depth  # (the start-up probe's; a caller that named no load)
        if self.guard.prefers_plain(load) or self.guard.measuring_plain(load):
            return 0  # (the next step decodes plainly: by the guard's rates, or to measure them afresh)
        speculate = self._guard_speculates(load)  # (as ``_decide`` has it)
        key = (load, tuple(self.last_cost.coefficients().tolist()), speculate)
        if key not in self._fresh:  # (one load at a time: the cache spares a wave's repeated prefill steps)
            rates = np.broadcast_to(self.tracker._population(), (load, self.tracker.max_depth))
            self._fresh = {key: self._solve(rates, speculate)[1]}
        return self._fresh[key]

    def _predicted_spec_step(self, num_requests: int) -> float:
        """Seconds of a step in which `num_requests` requests verify and draft the full depth, as
        the cost fit predicts it (0 before any fit)."""
        d = self.choices[-1]
        cost = self.last_cost
        return 0.0 if cost is None else cost(StepShape.of(num_requests, num_requests * d, d, self.kind,
                                                           spec_requests=num_requests))

    def draft_depth_for(self, num_running: int, planned: int) -> int:
        """The draft depth of a step whose drafts the next step verifies at `num_running` requests
        (the requests running once this step's prompts are admitted): none where plain decoding
        wins at that load, whose next step would drop the drafts (a new wave of prompts, admitted
        while a straggler of the last wave speculates at its own low load, or in a step of only
        prompts); else `planned` (this step's plan, or the depth in force)."""
        if self.policy == "measured" and self.guard.prefers_plain(num_running):
            return 0
        return planned

    def _record(self, decision: Decision) -> Decision:
        self.depth_counts.update(decision.depths.values())
        self.draft_depth_counts[decision.draft_depth] += 1
        return decision

    def observe_step(self, shape: StepShape, seconds: float, committed: int | None = None,
                     load: int | None = None, step: int | None = None) -> None:
        """A step's shape and duration (the cost fit); with `committed` (tokens the step
        committed) also the throughput guard, in the step's regime: plain if it verified and
        drafted nothing, else speculative. Every step of a regime counts: a step that only drafts
        pays for tokens the next step commits and one that only verifies commits what the last
        one paid for; prompt rows are priced per regime (``ThroughputGuard._rate_at``), a step
        that only admits prompts included. Left out of the guard: the start-up probe's steps; a load's first
        speculative steps (new shapes, whose first passes are slow on a CPU); the switches between
        regimes (a step that drafts with nothing to verify); the first `PLAIN_SETTLE_STEPS` plain
        steps after speculative ones: at 16 in flight on the CPU they ran 10.4, 9.7, 9.7, 9.6, 9.5,
        9.2 ms against the plain regime's 8.1-8.8 (caches and kernels warmed for the speculative
        shapes), so a plain block amid speculation, which a decision compares with the
        speculative regime's steady rate, would read plain decoding 10-15% slow
        (docs/METHODS.md §9). `load`: the load the
        step was decided at (``decide``), whose bucket of the guard the step feeds (default: its
        requests). `step`: the index of the decision it ran (``steps - 1`` right after its
        ``decide``; the default: the last decision), for an engine that observes a step only
        once the next one is decided."""
        self.costs.update(shape, seconds)
        speculative = shape.spec_requests > 0 or shape.draft_depth > 0
        # a switch into speculation: a step that drafts with nothing to verify (out of it: the
        # plain steps that settle)
        switch = speculative != (self._observed_draft_depth > 0) and shape.spec_requests == 0
        self._observed_draft_depth = shape.draft_depth
        self._plain_run = 0 if speculative else self._plain_run + 1
        if committed is None:  # (a step that only admits prompts: their price, nothing decoded)
            if not shape.prefill_rows:
                return
            committed = 0
        decided = self.steps - 1 if step is None else step
        settling = not speculative and self._plain_run <= PLAIN_SETTLE_STEPS
        skip = switch or settling or decided < len(self.probe) and self.policy == "measured"
        if speculative:
            # a load's first speculative steps (the start-up probe's and switches included) run new
            # shapes, whose first passes are slow on a CPU (at 2 in flight they once kept a load
            # plain for 1.4 s): they do not count
            bucket = self.guard.bucket(load or shape.requests)
            skip = skip or self._first_steps[bucket] < self.guard.min_steps
            self._first_steps[bucket] += 1
        # prompt chunks are priced per regime over the long run (``ThroughputGuard._rate_at``):
        # charged as they come, a plain regime's rate swung with the waves it admits, a retry's few
        # steps carried a whole wave's prompts or none (mode `sd` at 8 in flight: a 5-step retry
        # read 87.5 tokens per request-second against plain decoding's 140, where fixed-depth SD
        # realized 1.09x AR), and charged to speculation alone they kept the bench's `sd` engine
        # at 8 in flight plain (speculation 186 against plain decoding's 191 tokens per
        # request-second, where its own speculating drive realized 1.20x AR, its plain ones 0.93x)
        self.guard.observe(shape.requests, speculative, committed, seconds, counted=not skip, load=load,
                           prefill_rows=shape.prefill_rows, prefill_seconds=self._prefill_seconds(shape))

    def _prefill_seconds(self, shape: StepShape) -> float:
        """What the step's prompt chunks cost, as the cost fit has it: the step's predicted cost
        less that of the same step without them (0 before the first fit, or without a chunk)."""
        if not shape.prefill_rows or self.last_cost is None:
            return 0.0
        decode = StepShape.of(shape.requests, shape.rows - shape.requests - shape.prefill_rows, shape.draft_depth,
                              self.kind, spec_requests=shape.spec_requests)
        return max(0.0, self.last_cost(shape) - self.last_cost(decode))

    def observe_verification(self, request_id, num_draft_tokens: int, num_accepted: int) -> None:
        self.observe_verifications([request_id], [num_draft_tokens], [num_accepted])

    def observe_verifications(self, request_ids: list, num_draft_tokens: list[int], num_accepted: list[int]) -> None:
        """A step's verifications: drafted and accepted counts per request."""
        cap = self.tracker.max_depth
        self.tracker.record_many(request_ids, [min(n, cap) for n in num_draft_tokens],
                                 [min(a, n, cap) for a, n in zip(num_accepted, num_draft_tokens)])

    def finish(self, request_id) -> None:
        self.tracker.forget(request_id)

    def summary(self, refit: bool = True) -> dict:
        """Decisions so far and the cost estimates (JSON-ready); ``refit=False`` reports the fit the
        measured decisions use instead of fitting again."""
        cost = self.costs.fit() if refit and self.costs.count else self.last_cost
        return self._counts() | {
            "cost": None if cost is None else {name: getattr(cost, name) for name in COST_TERMS},
            "acceptance": [round(a, 4) for a in self.tracker._population().tolist()],
            "realized": self.guard.summary(),
        }

    def step_summary(self) -> dict:
        """``summary(refit=False)`` for every engine step: the decision counts are current, the
        estimates (cost, acceptance, realized rates) are refreshed every ``SUMMARY_EVERY`` steps.
        Building those every step took 0.5 ms of the engine-core process at 16 in flight, about
        7% of a plain step there (docs/BENCHMARKS.md, session 9)."""
        if self._estimates is None or self.steps - self._estimates[0] >= SUMMARY_EVERY:
            full = self.summary(refit=False)
            self._estimates = (self.steps, {k: full[k] for k in ("cost", "acceptance", "realized")})
        return self._counts() | self._estimates[1]

    def _counts(self) -> dict:
        return {
            "policy": self.policy,
            "steps": self.steps,
            # JSON object keys: the depth as a string
            "depths": {str(k): int(v) for k, v in sorted(self.depth_counts.items())},
            "draft_depths": {str(k): int(v) for k, v in sorted(self.draft_depth_counts.items())},
            # verifications that reached / accepted each draft position (vLLM's spec-decode
            # counters count the same: num_drafts = verified[0], accepted_per_position)
            "verified_per_position": [int(n) for n in self.tracker._pop_n.tolist()],
            "accepted_per_position": [int(n) for n in self.tracker._pop_s.tolist()],
            "tracked_requests": len(self.tracker._slot),  # requests with acceptance counts of their own
        }


def summary_delta(before: dict | None, after: dict) -> dict:
    """The decisions between two ``DepthController.summary()`` snapshots of one engine (a run's
    own share), with the mean verify depth and the share of plain (depth-0) request steps, and
    the cost estimates as of ``after``."""
    out = {"policy": after["policy"], "steps": after["steps"] - (before or {}).get("steps", 0), "cost": after["cost"],
           "overhead_ms": after.get("overhead_ms"), "window_ms": after.get("window_ms"),
           "loop_gap_ms": after.get("loop_gap_ms"),
           "realized": after.get("realized")}
    for key in ("depths", "draft_depths"):
        earlier = (before or {}).get(key, {})
        hist = {k: v - earlier.get(k, 0) for k, v in after[key].items()}
        out[key] = {k: v for k, v in sorted(hist.items(), key=lambda kv: int(kv[0])) if v}
    total = sum(out["depths"].values())
    out["mean_depth"] = round(sum(int(k) * v for k, v in out["depths"].items()) / total, 3) if total else None
    out["plain_share"] = round(out["depths"].get("0", 0) / total, 4) if total else None
    return out
