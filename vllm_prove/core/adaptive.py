"""Load-adaptive speculation depth, engine-free (issue 12): how many tokens each running request
speculates in the next engine step, from measured costs and measured acceptance.

Speculation pays only while extra query rows are cheap. With a step that runs `R` requests and
`rows = R + sum_r K_r` query rows (each request reads its last token plus `K_r` draft tokens),
the batch commits `sum_r E_r(K_r)` tokens in `t(rows, R)` seconds, where

    E_r(K)  = 1 + sum_{j=1..K} prod_{i=1..j} a_{r,i}      expected committed tokens at depth K
    t       = c_0 + c_req * R + c_row * rows              step cost, fitted online (StepCostModel)

and `a_{r,i}` is request r's probability of accepting draft position i given that every earlier
one was accepted (AcceptanceTracker: per-request counts with a population prior). The depths
maximize the batch's tokens per second `sum_r E_r(K_r) / t`. For a cost linear in rows the
maximum is exact by Dinkelbach's method: for a guess `lam` of the best rate, each request
independently maximizes `E_r(K) - lam * c_row * K`; the new rate becomes the next `lam`; the
rate rises strictly until it stops changing (a handful of iterations).

Depth 0 is a plain decode step for that request. `allowed` restricts a request's choices (a gated
ProVe mode speculates a full window or nothing: {0, B}). Nothing here touches decoding results:
lossless modes stay exact under any schedule; only speed depends on the choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

MAX_DINKELBACH_ITERS = 50  # the rate converges in < 10 iterations in practice; this bounds a bug


def expected_committed(
    # [batch, max_depth] float: a_{r,i}, acceptance of position i given 1..i-1 accepted
    accept: torch.Tensor,
) -> torch.Tensor:  # [batch, max_depth + 1]: E_r(K) for K = 0..max_depth
    """``E(K) = 1 + sum_{j<=K} prod_{i<=j} a_i`` (the bonus / recovered token always commits)."""
    survive = torch.cumprod(accept.double().clamp(0.0, 1.0), dim=-1)  # [batch, max_depth]
    zero = torch.zeros_like(survive[:, :1])
    return 1.0 + torch.cat([zero, torch.cumsum(survive, dim=-1)], dim=-1)


@dataclass
class StepCost:
    """``t = c_0 + c_req * requests + c_row * rows`` seconds."""

    c_0: float
    c_req: float
    c_row: float

    def __call__(self, rows: float, requests: float) -> float:
        return self.c_0 + self.c_req * requests + self.c_row * rows


def choose_depths(
    # [batch, max_depth + 1] float: E_r(K)
    expected: torch.Tensor,
    cost: StepCost,
    # [batch, max_depth + 1] bool or None: which depths request r may use (depth 0 always may)
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:  # [batch] int64: K_r
    """The depths that maximize ``sum_r E_r(K_r) / t(R + sum K_r, R)`` (Dinkelbach; exact for
    the linear cost). Ties go to the shorter depth."""
    batch, width = expected.shape
    if batch == 0:
        return torch.zeros(0, dtype=torch.int64)
    if allowed is None:
        allowed = torch.ones(batch, width, dtype=torch.bool)
    allowed = allowed.clone()
    allowed[:, 0] = True
    depth = torch.arange(width, dtype=torch.float64)  # [width]
    E = expected.double()
    choice = torch.zeros(batch, dtype=torch.int64)
    rate = _rate(E, choice, cost)
    for _ in range(MAX_DINKELBACH_ITERS):
        score = E - rate * max(cost.c_row, 0.0) * depth[None, :]  # [batch, width]
        score = torch.where(allowed, score, -math.inf)
        best = score.max(dim=-1, keepdim=True).values
        new = (score >= best - 1e-12).double().argmax(dim=-1)  # first (shortest) of the maxima
        new_rate = _rate(E, new, cost)
        if new_rate <= rate + 1e-12:
            break
        choice, rate = new, new_rate
    return choice


def _rate(E: torch.Tensor, choice: torch.Tensor, cost: StepCost) -> float:
    batch = E.shape[0]
    tokens = float(E.gather(1, choice[:, None]).sum())
    return tokens / cost(batch + float(choice.sum()), batch)


@dataclass
class StepCostModel:
    """Online least squares of step seconds on (1, requests, rows), exponentially forgetting old
    steps (the load and the machine change); `fit()` gives the current StepCost.

    Coefficients are kept non-negative (a query row never makes a step cheaper): the fit is
    re-solved without a coefficient that comes out negative."""

    forget: float = 0.98  # weight of the past per new step: an effective memory of ~50 steps
    _xtx: torch.Tensor = field(default_factory=lambda: torch.zeros(3, 3, dtype=torch.float64))
    _xty: torch.Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.float64))
    count: int = 0

    def update(self, rows: int, requests: int, seconds: float) -> None:
        if rows < requests or requests < 0 or not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"a step needs rows >= requests >= 0 and finite seconds >= 0, "
                             f"got rows={rows}, requests={requests}, seconds={seconds}")
        x = torch.tensor([1.0, float(requests), float(rows)], dtype=torch.float64)
        self._xtx = self.forget * self._xtx + torch.outer(x, x)
        self._xty = self.forget * self._xty + seconds * x
        self.count += 1

    def fit(self) -> StepCost:
        if self.count == 0:
            raise ValueError("no step measured yet: run the start-up probe first")
        active = [0, 1, 2]
        for _ in range(3):
            idx = torch.tensor(active)
            a = self._xtx[idx][:, idx] + 1e-9 * torch.eye(len(active), dtype=torch.float64)
            coef = torch.linalg.lstsq(a, self._xty[idx]).solution
            negative = [active[i] for i, c in enumerate(coef.tolist()) if c < 0]
            if not negative:
                break
            active = [i for i in active if i not in negative]
            if not active:
                coef = torch.zeros(0, dtype=torch.float64)
                break
        full = [0.0, 0.0, 0.0]
        for i, c in zip(active, coef.tolist()):
            full[i] = max(c, 0.0)
        return StepCost(*full)


@dataclass
class AcceptanceTracker:
    """Per-request acceptance of each draft position, shrunk towards the population.

    ``a_{r,i} = (s_{r,i} + prior * p_i) / (n_{r,i} + prior)``: ``n`` = times position i was
    drafted with 1..i-1 accepted, ``s`` = times it was then accepted too; ``p_i`` is the same
    ratio over every request seen (with `initial` before any data)."""

    max_depth: int
    prior: float = 4.0  # pseudo-observations of the population a request starts with
    initial: float = 0.5  # the population's acceptance before anything is measured
    _pop_n: torch.Tensor = field(init=False)
    _pop_s: torch.Tensor = field(init=False)
    _n: dict = field(default_factory=dict)
    _s: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._pop_n = torch.zeros(self.max_depth, dtype=torch.float64)
        self._pop_s = torch.zeros(self.max_depth, dtype=torch.float64)

    def record(self, request_id, num_draft_tokens: int, num_accepted: int) -> None:
        """One verification: positions 1..min(n, a+1) were reached; 1..a were accepted."""
        if not 0 <= num_accepted <= num_draft_tokens <= self.max_depth:
            raise ValueError(f"need 0 <= accepted ({num_accepted}) <= drafted ({num_draft_tokens}) "
                             f"<= max_depth ({self.max_depth})")
        reached = torch.zeros(self.max_depth, dtype=torch.float64)
        reached[: min(num_draft_tokens, num_accepted + 1)] = 1.0
        accepted = torch.zeros(self.max_depth, dtype=torch.float64)
        accepted[:num_accepted] = 1.0
        n = self._n.setdefault(request_id, torch.zeros(self.max_depth, dtype=torch.float64))
        s = self._s.setdefault(request_id, torch.zeros(self.max_depth, dtype=torch.float64))
        n += reached
        s += accepted
        self._pop_n += reached
        self._pop_s += accepted

    def forget(self, request_id) -> None:
        """A finished request leaves (the population keeps what it taught)."""
        self._n.pop(request_id, None)
        self._s.pop(request_id, None)

    def population(self) -> torch.Tensor:  # [max_depth]
        return torch.where(self._pop_n > 0, self._pop_s / self._pop_n.clamp(min=1), self.initial)

    def rates(self, request_ids: list) -> torch.Tensor:  # [batch, max_depth]
        pop = self.population()
        zero = torch.zeros(self.max_depth, dtype=torch.float64)
        n = torch.stack([self._n.get(r, zero) for r in request_ids]) if request_ids else zero[None, :0]
        s = torch.stack([self._s.get(r, zero) for r in request_ids]) if request_ids else zero[None, :0]
        return (s + self.prior * pop) / (n + self.prior)
