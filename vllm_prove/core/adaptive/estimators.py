"""What the adaptive depth measures: step shapes and their fitted costs, and acceptance per
draft position (docs/METHODS.md §9, "Measurement").

    E_r(K)  = 1 + sum_{j=1..K} prod_{i=1..j} a_{r,i}      expected committed tokens at depth K
    t       = c_0 + c_req R + c_row rows + c_spec_req S
              + c_pass passes + c_draft_row draft_rows + c_draft_req draft_requests      (StepCost)

A step runs ``R`` requests; request r verifies ``K_r`` drafts (``rows = R + sum K_r``, ``S`` =
requests with ``K_r > 0``); the drafter's passes and rows follow from the draft depth ``D`` and
its kind (``StepShape.of``). ``a_{r,i}`` is request r's probability of accepting draft position i
given that every earlier one was accepted (``AcceptanceTracker``); the cost terms are fitted
online from the engine's own step timings (``StepCostModel``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import numpy as np
import torch


def expected_committed(
    # [batch, max_depth] float: a_{r,i}, acceptance of position i given 1..i-1 accepted
    accept: torch.Tensor,
) -> torch.Tensor:  # [batch, max_depth + 1]: E_r(K) for K = 0..max_depth
    """``E(K) = 1 + sum_{j<=K} prod_{i<=j} a_i`` (the bonus / recovered token always commits)."""
    return torch.from_numpy(expected_np(accept.double().numpy()))


def expected_np(accept: np.ndarray) -> np.ndarray:  # [batch, max_depth] -> [batch, max_depth + 1]
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
    # throughput guard that a step carried a prompt chunk ...
    prefill_rows: int = field(default=0, compare=False)
    admitted: int = field(default=0, compare=False)  # ... and how many prompts began in it (the guard's price per prompt)

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
        return torch.from_numpy(self.population_array().copy())

    def population_array(self) -> np.ndarray:  # [max_depth] float64 (read-only: cached)
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
        return torch.from_numpy(self.rate_array(request_ids))

    def rate_array(self, request_ids: list) -> np.ndarray:  # [batch, max_depth] float64
        if not request_ids:
            return np.zeros((0, self.max_depth))
        counts = self._counts[[self._slot.get(r, 0) for r in request_ids]]  # [batch, 2, W]
        return (counts[:, 1] + self.prior * self.population_array()) / (counts[:, 0] + self.prior)

    def verified_per_position(self) -> list[int]:
        """Verifications that reached each draft position, over every request seen (vLLM's
        spec-decode counters count the same: ``num_drafts`` = position 1's)."""
        return [int(n) for n in self._pop_n.tolist()]

    def accepted_per_position(self) -> list[int]:
        return [int(n) for n in self._pop_s.tolist()]

    def tracked_requests(self) -> int:
        """Requests with acceptance counts of their own (each leaves with ``forget``)."""
        return len(self._slot)
