"""Cost model: ideal speedup from pass costs (docs/METHODS.md §6) and the skip break-even (§7).

Costs are in *proposer-pass equivalents*: one forward pass of the large model over the
window (ProVe appendix A). A cycle costs

- AR: ``1`` (one pass, one token),
- ProVe: ``1 + rho`` (propose + small-verifier pass, ``rho = verifier / proposer``),
- SD: ``1 + k * rho`` (k serial small-model drafts + one large verify pass),
- ProVe-lossless: ``2`` (propose + self-verify),

plus optional scheduling/cache overhead, also in proposer passes. Then
``ideal speedup = committed tokens per cycle * AR pass cost / cycle cost``.
Paper numbers (two GPUs): AR 14.8 ms, 32B window pass 15.6 ms, 3B verifier 5.0 ms,
7B verifier 5.8 ms; overhead 8.7 ms per lossless cycle, 4 ms per ProVe cycle.
"""

from __future__ import annotations

import math

AR_CYCLE_COST = 1.0  # one proposer pass commits one token
LOSSLESS_CYCLE_COST = 2.0  # propose pass + self-verify pass (ProVe §3.3)


def _check_positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):  # rejects NaN too
        raise ValueError(f"{name} must be a positive finite number, got {value}")


def _check_non_negative(name: str, value: float) -> None:
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a non-negative finite number, got {value}")


def rho_from_pass_times(verifier_pass_s: float, proposer_pass_s: float) -> float:
    """``rho`` = verifier pass time / proposer pass time (any one time unit)."""
    _check_positive("verifier_pass_s", verifier_pass_s)
    _check_positive("proposer_pass_s", proposer_pass_s)
    return verifier_pass_s / proposer_pass_s


def prove_cycle_cost(rho: float, overhead: float = 0.0) -> float:
    """ProVe cycle cost ``1 + rho + overhead`` in proposer passes (docs/METHODS.md §6)."""
    _check_positive("rho", rho)
    _check_non_negative("overhead", overhead)
    return 1.0 + rho + overhead


def sd_cycle_cost(k: int, rho: float, overhead: float = 0.0) -> float:
    """Speculative-decoding cycle cost ``1 + k * rho + overhead`` (docs/METHODS.md §5, §6)."""
    if k < 1:
        raise ValueError(f"k (draft tokens per cycle) must be >= 1, got {k}")
    _check_positive("rho", rho)
    _check_non_negative("overhead", overhead)
    return 1.0 + k * rho + overhead


def lossless_cycle_cost(overhead: float = 0.0) -> float:
    """ProVe-lossless cycle cost ``2 + overhead`` (docs/METHODS.md §6)."""
    _check_non_negative("overhead", overhead)
    return LOSSLESS_CYCLE_COST + overhead


def ideal_speedup(
    committed_per_cycle: float,
    cycle_cost_in_proposer_passes: float,
    ar_pass_cost: float = AR_CYCLE_COST,
) -> float:
    """``committed_per_cycle * ar_pass_cost / cycle_cost`` over greedy AR decoding (§6).

    ``ar_pass_cost`` is one AR pass in proposer passes: 1 in the idealized model, 14.8/15.6
    with the paper's measured times (the window pass is a little dearer than an AR step).
    """
    if committed_per_cycle < 1:  # every cycle commits y_1 at least
        raise ValueError(f"committed_per_cycle must be >= 1, got {committed_per_cycle}")
    _check_positive("cycle_cost_in_proposer_passes", cycle_cost_in_proposer_passes)
    _check_positive("ar_pass_cost", ar_pass_cost)
    return committed_per_cycle * ar_pass_cost / cycle_cost_in_proposer_passes


def break_even_skip_length(A: float, c_D: float, c_V: float) -> float:
    """``K* = A * c_D / (c_D + c_V)`` (SDD-skipping paper eq. 8; docs/METHODS.md §7).

    A strict round commits ``A`` tokens on average for ``c_D + c_V``; a skip of length ``K``
    costs ``c_D``. The skip has the higher local throughput exactly when ``K > K*``.
    """
    _check_positive("A", A)
    _check_positive("c_D", c_D)
    _check_positive("c_V", c_V)
    return A * c_D / (c_D + c_V)
