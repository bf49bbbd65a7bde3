"""Load-adaptive speculation depth, engine-free (docs/METHODS.md §9 states the policy).

Two questions, two mechanisms: *whether* a load speculates is a two-armed choice on measured
throughput (``guard.SpeculationGuard``); *how deep* is the solver's (``solver.solve``: measured
acceptance and an online cost fit, Dinkelbach's method). ``controller.DepthController`` is the
per-step policy the engine calls (``vllm_prove/engine/adaptive.py``); ``estimators`` holds what
both measure (step shapes and costs, acceptance per draft position).
"""

from vllm_prove.core.adaptive.controller import (
    PLAIN_REFIT_EVERY, POLICIES, SUMMARY_EVERY, Decision, DepthController, summary_delta)
from vllm_prove.core.adaptive.estimators import (
    COST_TERMS, AcceptanceTracker, DraftKind, StepCost, StepCostModel, StepShape, expected_committed, expected_np)
from vllm_prove.core.adaptive.guard import (
    BLOCK_STEPS, CONFIDENCE_Z, DISCOUNT, EXPLORE_BUDGET, FREE_PAIRS, MODEL_SPREAD, SETTLE_STEPS, SpeculationGuard)
from vllm_prove.core.adaptive.solver import Plan, choose_depths, solve

__all__ = [
    "BLOCK_STEPS", "CONFIDENCE_Z", "COST_TERMS", "DISCOUNT", "EXPLORE_BUDGET", "FREE_PAIRS", "MODEL_SPREAD", "PLAIN_REFIT_EVERY",
    "POLICIES", "SETTLE_STEPS", "SUMMARY_EVERY", "AcceptanceTracker", "Decision", "DepthController", "DraftKind",
    "Plan", "SpeculationGuard", "StepCost", "StepCostModel", "StepShape", "choose_depths", "expected_committed",
    "expected_np", "solve", "summary_delta",
]
