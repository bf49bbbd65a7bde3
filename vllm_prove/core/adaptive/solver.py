"""How deep to speculate: the verify depths ``K_r`` and the draft depth ``D`` that maximize the
batch's expected committed tokens per second under the fitted step cost (docs/METHODS.md §9,
"Choice").

    rate(K, D) = sum_r E_r(K_r) / t(StepShape.of(R, sum_r K_r, D))

For each ``D`` the rate is a ratio of a separable sum and a cost linear in ``sum K_r``, which
Dinkelbach's method maximizes exactly: for a guess ``lam`` of the best rate each request maximizes
``E_r(K) - lam * own(K)`` (``own``: what verifying K drafts adds to the step, its rows and its
multi-token query); the rate rises strictly until it stops changing. The best ``D`` wins; ties go
to the shallower depth. Whether to speculate at all is not this module's question (the guard's).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from vllm_prove.core.adaptive.estimators import DraftKind, StepCost, StepShape

MAX_DINKELBACH_ITERS = 50  # the rate converges in < 10 iterations in practice; this bounds a bug


@dataclass(frozen=True)
class Plan:
    """The solver's answer: each request's verify depth, the batch's draft depth, and the
    expected committed tokens per second it achieves under the cost it was solved with."""

    depths: np.ndarray  # [batch] int64: K_r
    draft_depth: int  # D >= max K_r
    rate: float  # sum_r E_r(K_r) / t, tokens per second


def solve(
    # [batch, max_depth + 1] float: E_r(K)
    expected: np.ndarray,
    cost: StepCost,
    kind: DraftKind = DraftKind.PARALLEL,
    # [batch, max_depth + 1] bool or None: which depths request r may use (depth 0 always may)
    allowed: np.ndarray | None = None,
    min_draft_depth: int = 0,
) -> Plan:
    """The rate-maximizing plan with ``D >= min_draft_depth`` (1: a speculative plan, 0: plain
    decoding competes too). Runs once per engine step at most, so it is numpy, vectorized over
    every ``D`` at once (~0.1 ms for 32 requests and B = 8)."""
    E = np.asarray(expected, dtype=np.float64)
    batch, width = E.shape
    if batch == 0:
        return Plan(np.zeros(0, dtype=np.int64), 0, 0.0)
    if not 0 <= min_draft_depth < width:
        raise ValueError(f"min_draft_depth must be in [0, {width - 1}], got {min_draft_depth}")
    ok = np.ones((batch, width), dtype=bool) if allowed is None else np.array(allowed, dtype=bool)
    ok[:, 0] = True
    depth = np.arange(width)
    ok = ok[None, :, :] & (depth[None, None, :] <= depth[:, None, None])  # [D, batch, K]: K <= D
    fixed, own = step_costs(batch, width, kind, tuple(cost.coefficients().tolist()))
    rows = np.arange(batch)
    choice = np.zeros((width, batch), dtype=np.int64)  # [D, batch]: start from verifying nothing
    tiny = 1e-12  # (a fit that prices a step at 0 s: a huge rate, never a division by zero)
    rate = E[rows[None, :], choice].sum(axis=1) / np.maximum(fixed + own[choice].sum(axis=1), tiny)
    for _ in range(MAX_DINKELBACH_ITERS):
        score = np.where(ok, E[None] - rate[:, None, None] * own[None, None, :], -np.inf)
        new = score.argmax(axis=-1)  # [D, batch]: the first (shortest) of the maxima
        new_rate = E[rows[None, :], new].sum(axis=1) / np.maximum(fixed + own[new].sum(axis=1), tiny)
        improved = new_rate > rate + 1e-12
        if not improved.any():
            break
        choice[improved], rate[improved] = new[improved], new_rate[improved]
    rate[:min_draft_depth] = -np.inf
    best = int(np.flatnonzero(rate >= rate.max() - 1e-12)[0])  # the shallowest of the best D
    return Plan(choice[best].copy(), best, float(rate[best]))


def choose_depths(
    # [batch, max_depth + 1] float: E_r(K)
    expected: torch.Tensor | np.ndarray,
    cost: StepCost,
    kind: DraftKind = DraftKind.PARALLEL,
    # [batch, max_depth + 1] bool or None: which depths request r may use (depth 0 always may)
    allowed: torch.Tensor | np.ndarray | None = None,
    min_draft_depth: int = 0,
) -> tuple[torch.Tensor, int]:  # ([batch] int64 K_r, draft depth D >= max K_r)
    """``solve`` with tensors in and out: the verify depths and the draft depth."""
    as_np = lambda x: x.numpy() if isinstance(x, torch.Tensor) else x  # noqa: E731
    plan = solve(as_np(expected), cost, kind, None if allowed is None else as_np(allowed), min_draft_depth)
    return torch.from_numpy(plan.depths), plan.draft_depth


@functools.lru_cache(maxsize=256)
def step_costs(batch: int, width: int, kind: DraftKind, coefficients: tuple) -> tuple[np.ndarray, np.ndarray]:
    """``solve``'s two cost vectors: the cost of a step of ``batch`` requests with draft depth D
    and no verified draft ([width], by D), and what a request verifying K drafts adds to any step
    (its rows, its multi-token query; [width], by K): a step's cost is a sum of the two. Cached:
    the fit changes every few steps, the batch size rarely, and building the shapes is most of a
    solve's time (read-only arrays)."""
    cost = StepCost(*coefficients)
    fixed = np.array([cost(StepShape.of(batch, 0, d, kind)) for d in range(width)])
    # a request verifies K > 0 drafts only in a step that drafts (D >= K_r), where the sequential
    # draft model's first pass reads its verified rows too: the K-terms are measured at D = 1
    base = cost(StepShape.of(batch, 0, 1, kind))
    own = np.array([0.0] + [cost(StepShape.of(batch, k, 1, kind, spec_requests=1)) - base for k in range(1, width)])
    fixed.setflags(write=False)
    own.setflags(write=False)
    return fixed, own
