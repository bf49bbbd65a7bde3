"""The per-step policy the engine calls (docs/METHODS.md §9): the guard says whether a load
speculates, the solver how deep; the controller measures, decides and reports.

Nothing here touches decoding results: lossless modes stay exact under any schedule; only speed
depends on the choice. ``vllm_prove/engine/adaptive.py`` measures and applies it inside vLLM.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass

import numpy as np

from vllm_prove.core.adaptive.estimators import (
    COST_TERMS, AcceptanceTracker, DraftKind, StepCost, StepCostModel, StepShape, expected_np)
from vllm_prove.core.adaptive.guard import SpeculationGuard
from vllm_prove.core.adaptive.solver import solve

PLAIN_REFIT_EVERY = 64  # steps between cost fits while a load decodes plainly (the fit only sets the guard's prior there)
SUMMARY_EVERY = 16  # steps between refreshes of the estimates in DepthController.step_summary
POLICIES = ("measured", "random", "plain", "speculate")


@dataclass
class Decision:
    """One step's plan: each request's verify depth ``K_r`` (at most the drafts it holds) and the
    depth ``D`` every request drafts for the next step."""

    depths: dict
    draft_depth: int
    explored: bool
    load: int = 0  # the load it judged (what the step's observation names: ``observe_step(load=...)``)


class DepthController:
    """Measured costs and acceptance -> each step's depths.

    ``policy="measured"`` (the default): the start-up probe runs a few draft depths once
    so the cost fit has seen cheap and dear steps; afterwards the guard (``SpeculationGuard``)
    says per load whether to speculate, and where it does the solver plans the depths (``D >= 1``),
    one step in ``explore_every`` trying a neighbouring draft depth so the fit keeps seeing more
    than one step shape. The fit, and with it the plan for an unchanged set of requests, is
    refreshed every ``refit_every`` steps.
    ``policy="speculate"``: the solver's plan every step, no guard (a load that must speculate,
    whatever it measures). ``policy="plain"``: plain decoding every step (the engine's cost
    without drafts). ``policy="random"``: random depths every step (the exactness tests'
    schedule driver). ``allowed`` restricts the depths (a window-or-none mode: ``allowed=(B,)``)."""

    def __init__(self, max_depth: int, kind: DraftKind, policy: str = "measured", allowed: tuple[int, ...] | None = None,
                 explore_every: int = 32, refit_every: int = 8, seed: int = 0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.max_depth, self.kind, self.policy = max_depth, DraftKind(kind), policy
        self.choices = sorted({0, *(allowed if allowed is not None else range(max_depth + 1))})
        if self.choices[-1] > max_depth:
            raise ValueError(f"allowed depths {self.choices} exceed max_depth {max_depth}")
        self._allowed_row = np.zeros(max_depth + 1, dtype=bool)
        self._allowed_row[self.choices] = True
        # the probe: deepest twice, half, one, none (enough shapes to tell the cost terms apart; each
        # speculative step at a high load costs several plain ones, so no more). A step verifies at
        # most the drafts the step before it drafted, so the depths fall: every drafting step's
        # drafts are verified by the next, and the fit sees verification rows of each depth
        full = self.choices[-1]
        half = next(d for d in self.choices if d >= max(1, full // 2))
        self.probe = [full, full, *dict.fromkeys(d for d in (half, self.choices[1]) if d != full), 0]
        if policy != "measured":
            self.probe = []  # (the probe serves the guard's first decisions)
        self.explore_every, self.refit_every = explore_every, refit_every
        self.tracker = AcceptanceTracker(max_depth=max(max_depth, 1))
        self.costs = StepCostModel()
        self.guard = SpeculationGuard(prior=self.model_log_ratio)
        self.steps = 0
        self.depth_counts: Counter = Counter()  # K_r over every (request, step) decided
        self.draft_depth_counts: Counter = Counter()
        self.last_cost: StepCost | None = None  # the fit the decisions use
        self._fit_step = 0  # the step of the last fit
        self._last_draft_depth = self.choices[-1]
        self._cached: tuple = ((), {}, 0)  # (request ids, depths, D) of the last solve
        self._fresh: dict = {}  # (load, fit) -> a prefill-only step's draft depth
        self._decoding_load = 0  # the load of the last decision with decoding requests
        self._rng = random.Random(seed)
        self._estimates: tuple[int, dict] | None = None  # (steps, estimates) of step_summary
        self._spec_bucket = -1  # the guard's heaviest bucket where a speculative step has run (probe included)

    # -- deciding -------------------------------------------------------------------------------
    def decide(self, request_ids: list, pinned=frozenset(), load: int | None = None) -> Decision:
        """Depths for the decoding ``request_ids``. ``load``: the requests the step will run
        (default: the decoding ones), the load the guard judges and the step's observation names
        (``observe_step(load=...)``); a step that only admits prompts is judged at no less than the
        last decoding step's load (docs/METHODS.md §9, "Which load"). While any ``pinned`` request
        runs, the whole batch takes the full depth (a seeded sampler's text must not depend on the
        load: docs/METHODS.md §9, "Seeded sampling")."""
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
        if request_ids:
            self.depth_counts.update(decision.depths.values())
            self.draft_depth_counts[decision.draft_depth] += 1
        return decision

    def _decide(self, request_ids: list, load: int) -> Decision:
        if not request_ids:  # a prefill-only step: its requests draft for the next one, at `load`
            return Decision({}, self._fresh_draft_depth(load), False)
        step, self.steps = self.steps, self.steps + 1
        if self.policy == "plain":
            return Decision(dict.fromkeys(request_ids, 0), 0, False)
        if self.policy == "random":
            d = self._rng.choice(self.choices)
            return Decision({r: self._rng.choice([k for k in self.choices if k <= d]) for r in request_ids}, d, True)
        if step < len(self.probe) or self.costs.count == 0:
            d = self.probe[step % len(self.probe)] if self.probe else self.choices[-1]
            return Decision({r: d for r in request_ids}, d, True)
        if self.last_cost is None:
            self._refit(step, 0)  # (the guard's first look at a load asks the model)
        if not self._speculates(load):
            self._refit(step, PLAIN_REFIT_EVERY)
            return Decision(dict.fromkeys(request_ids, 0), 0, False)
        if step % self.explore_every == 0:  # a neighbouring draft depth, for the cost fit
            i = self.choices.index(self._last_draft_depth) if self._last_draft_depth in self.choices else 0
            near = {self.choices[max(i - 1, 1)], self.choices[min(i + 1, len(self.choices) - 1)]}
            near -= {0, self._last_draft_depth}
            if near:
                d = self._rng.choice(sorted(near))
                return Decision({r: d for r in request_ids}, d, True)
        self._solve_cached(request_ids, self._refit(step, self.refit_every))
        _, depths, d = self._cached
        self._last_draft_depth = d
        return Decision(dict(depths), d, False)

    def _speculates(self, load: int) -> bool:
        return self.policy == "speculate" or self.guard.speculates(load)

    def _solve_cached(self, request_ids: list, refit: bool) -> None:
        """The solver's plan for ``request_ids`` into ``_cached``: solved again after a new fit or
        for other requests; else the same requests keep their depths until the next fit."""
        key = tuple(request_ids)
        if refit or key != self._cached[0]:
            plan = self._plan(self.tracker.rate_array(request_ids))
            self._cached = (key, dict(zip(request_ids, plan.depths.tolist())), plan.draft_depth)

    def _plan(self, rates: np.ndarray):
        """The best speculative plan (``D >= 1``) for requests with acceptance ``rates``."""
        expected = expected_np(rates[:, : self.max_depth])
        allowed = np.broadcast_to(self._allowed_row, (len(expected), self.max_depth + 1))
        return solve(expected, self.last_cost, self.kind, allowed, min_draft_depth=1)

    def prepare(self, request_ids: list, load: int) -> None:
        """The fit and the solve the next decision would make for ``request_ids`` at ``load``, made
        ahead (an engine calls this while its workers run a step): only where the next decision
        is the solver's and a fit or a solve is due. The guard's state is read, never advanced."""
        if self.policy not in ("measured", "speculate") or not request_ids or self.last_cost is None \
                or self.steps < len(self.probe) or not self._speculates(load):
            return
        step = self.steps  # (the next decision's index)
        if step % self.explore_every == 0:
            return  # (it may explore: ``_decide``, which then fits a step later)
        fresh = step - self._fit_step >= self.refit_every
        if fresh:
            self.last_cost, self._fit_step = self.costs.fit(), step
        self._solve_cached(request_ids, fresh)

    def _refit(self, step: int, every: int) -> bool:
        """Fit the step costs afresh if the fit in use is ``every`` steps old (or there is none)."""
        if self.last_cost is not None and step - self._fit_step < every:
            return False
        self.last_cost, self._fit_step = self.costs.fit(), step
        return True

    def _fresh_draft_depth(self, load: int) -> int:
        """The draft depth of a step that only admits prompts: what the next step, ``load``
        requests new to the acceptance estimates, is planned to verify (not the depth last in
        force, which a lower load may have left)."""
        if self.policy in ("plain", "random"):
            return 0 if self.policy == "plain" else self.choices[-1]
        if self.last_cost is None or load < 1:
            return self._last_draft_depth  # (the start-up probe's; a caller that named no load)
        if not self._speculates(load):
            return 0
        key = (load, tuple(self.last_cost.coefficients().tolist()))
        if key not in self._fresh:  # (one load at a time: the cache spares a wave's repeated prefill steps)
            rates = np.broadcast_to(self.tracker.population_array(), (load, self.tracker.max_depth))
            self._fresh = {key: self._plan(rates).draft_depth}
        return self._fresh[key]

    def draft_depth_for(self, num_running: int, planned: int) -> int:
        """The draft depth of a step whose drafts the next step verifies at ``num_running``
        requests: none where that load decodes plainly (its next step would drop the drafts),
        else ``planned``."""
        if self.policy == "measured" and self.steps >= len(self.probe) and not self.guard.speculates(num_running):
            return 0
        return planned

    def model_log_ratio(self, load: int) -> float | None:
        """The cost model's predicted ``log(rate_speculate / rate_plain)`` at ``load`` requests with
        the population's acceptance, each arm's tokens per request-second charged its admission
        price as the guard measures it (``SpeculationGuard.prompt_price``): the guard's prior.
        None before the fit has seen as many steps as it has terms (fitted to the probe alone, any
        split of the time between the terms fits), and at a load heavier than every bucket where a
        speculative step has run: there the fit extrapolates the drafter's and the verifier's rows
        from lighter steps, which is no evidence (docs/METHODS.md §9, "The model as a prior")."""
        if self.last_cost is None or load < 1 or self.costs.count < len(COST_TERMS) \
                or self.guard.bucket(load) > self._spec_bucket:
            return None
        rates = np.broadcast_to(self.tracker.population_array(), (load, self.tracker.max_depth))
        speculate = self._plan(rates).rate / load  # (tokens per request-second)
        plain = 1 / max(self.last_cost(StepShape.of(load, 0, 0, self.kind)), 1e-12)
        # (request-seconds per token: decoding's, then admission's)
        spend = [1 / max(rate, 1e-12) + self.guard.prompt_price(arm) for arm, rate in ((False, plain), (True, speculate))]
        return math.log(spend[0] / spend[1])

    # -- measuring ------------------------------------------------------------------------------
    def observe_step(self, shape: StepShape, seconds: float, committed: int | None = None,
                     load: int | None = None, step: int | None = None) -> None:
        """A step's shape and duration (the cost fit); with ``committed`` (tokens the step
        committed; None for a step that only admits prompts) also the guard, in the step's arm:
        plain if it verified and drafted nothing, else speculative. ``load``: the load the step
        was decided at (``decide``); ``step``: the index of its decision (default: the last), for
        an engine that observes a step once the next one is decided. The start-up probe's steps
        feed only the fit."""
        self.costs.update(shape, seconds)
        if shape.spec_requests or shape.draft_depth:
            self._spec_bucket = max(self._spec_bucket, self.guard.bucket(load or shape.requests))
        if committed is None and not shape.prefill_rows:
            return
        decided = self.steps - 1 if step is None else step
        if self.policy != "measured" or decided < len(self.probe):
            return
        speculative = shape.spec_requests > 0 or shape.draft_depth > 0
        self.guard.observe(load or shape.requests, speculative, committed, seconds, shape.requests,
                           prefill_seconds=self._prefill_seconds(shape), admitted=shape.admitted)

    def _prefill_seconds(self, shape: StepShape) -> float:
        """What the step's prompt rows cost as the cost fit has it: the step's predicted cost less
        that of the same step without them (0 before the first fit, or without prompt rows)."""
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

    def expect(self, max_tokens: int) -> None:
        """A request was admitted that may commit up to ``max_tokens`` tokens (the guard's
        length of a request before any has finished)."""
        self.guard.expect(max_tokens)

    def finish(self, request_id, tokens: int | None = None) -> None:
        """A request left the engine, having committed ``tokens`` output tokens (None: unknown)."""
        self.tracker.forget(request_id)
        if tokens is not None:
            self.guard.finished(tokens)

    # -- reporting ------------------------------------------------------------------------------
    def summary(self, refit: bool = True) -> dict:
        """Decisions so far and the estimates (JSON-ready); ``refit=False`` reports the fit the
        decisions use instead of fitting again."""
        cost = self.costs.fit() if refit and self.costs.count else self.last_cost
        return self._counts() | {
            "cost": None if cost is None else {name: getattr(cost, name) for name in COST_TERMS},
            "acceptance": [round(a, 4) for a in self.tracker.population_array().tolist()],
            "realized": self.guard.summary(),
            "block_noise": round(self.guard.noise(), 4),
        }

    def step_summary(self) -> dict:
        """``summary(refit=False)`` for every engine step: the decision counts are current, the
        estimates refreshed every ``SUMMARY_EVERY`` steps (building them takes ~0.5 ms)."""
        if self._estimates is None or self.steps - self._estimates[0] >= SUMMARY_EVERY:
            full = self.summary(refit=False)
            self._estimates = (self.steps, {k: full[k] for k in ("cost", "acceptance", "realized", "block_noise")})
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
            "verified_per_position": self.tracker.verified_per_position(),
            "accepted_per_position": self.tracker.accepted_per_position(),
            "tracked_requests": self.tracker.tracked_requests(),
        }


def summary_delta(before: dict | None, after: dict) -> dict:
    """The decisions between two ``DepthController.summary()`` snapshots of one engine (a run's
    own share), with the mean verify depth and the share of plain (depth-0) request steps, and
    the estimates as of ``after``."""
    out = {"policy": after["policy"], "steps": after["steps"] - (before or {}).get("steps", 0), "cost": after["cost"],
           "overhead_ms": after.get("overhead_ms"), "window_ms": after.get("window_ms"),
           "loop_gap_ms": after.get("loop_gap_ms"), "realized": after.get("realized")}
    for key in ("depths", "draft_depths"):
        earlier = (before or {}).get(key, {})
        hist = {k: v - earlier.get(k, 0) for k, v in after[key].items()}
        out[key] = {k: v for k, v in sorted(hist.items(), key=lambda kv: int(kv[0])) if v}
    total = sum(out["depths"].values())
    out["mean_depth"] = round(sum(int(k) * v for k, v in out["depths"].items()) / total, 3) if total else None
    out["plain_share"] = round(out["depths"].get("0", 0) / total, 4) if total else None
    return out
