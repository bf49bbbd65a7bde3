"""The engine-free core: contracts, acceptance rules, skip policy, metrics, cost model.

Nothing here imports vllm (tests/core/test_core_no_vllm.py checks it); the vLLM adapters live in
``vllm_prove.engine`` and call these functions.
"""

from vllm_prove.core.contracts import PLACEHOLDER_TOKEN_ID, BlockProposal, Verdict
from vllm_prove.core.cost_model import (
    AR_CYCLE_COST,
    LOSSLESS_CYCLE_COST,
    break_even_skip_length,
    ideal_speedup,
    lossless_cycle_cost,
    prove_cycle_cost,
    rho_from_pass_times,
    sd_cycle_cost,
)
from vllm_prove.core.metrics import (
    CycleStats,
    ar_matching_prefix_length,
    auc,
    committed_histogram,
    full_prefix_acceptance,
    mean_committed_per_cycle,
    strict_token_agreement,
    throughput,
)
from vllm_prove.core.rules import (
    GATES,
    GateKind,
    accepted_prefix_length,
    apply_gate,
    lenient_accept,
    lossless_greedy,
    product_gate,
    proposer_only_gate,
    strict_greedy,
    topk_accept,
    verifier_only_gate,
)
from vllm_prove.core.skip_policy import (
    NO_FEASIBLE_PREFIX,
    GuardFlags,
    PrefixGate,
    SkipDecision,
    SkipPolicy,
    feasible_prefix,
    guard_flags,
)

__all__ = [
    "AR_CYCLE_COST",
    "GATES",
    "LOSSLESS_CYCLE_COST",
    "NO_FEASIBLE_PREFIX",
    "PLACEHOLDER_TOKEN_ID",
    "BlockProposal",
    "CycleStats",
    "GateKind",
    "GuardFlags",
    "PrefixGate",
    "SkipDecision",
    "SkipPolicy",
    "Verdict",
    "accepted_prefix_length",
    "apply_gate",
    "ar_matching_prefix_length",
    "auc",
    "break_even_skip_length",
    "committed_histogram",
    "feasible_prefix",
    "full_prefix_acceptance",
    "guard_flags",
    "ideal_speedup",
    "lenient_accept",
    "lossless_cycle_cost",
    "lossless_greedy",
    "mean_committed_per_cycle",
    "product_gate",
    "proposer_only_gate",
    "prove_cycle_cost",
    "rho_from_pass_times",
    "sd_cycle_cost",
    "strict_greedy",
    "strict_token_agreement",
    "throughput",
    "topk_accept",
    "verifier_only_gate",
]
