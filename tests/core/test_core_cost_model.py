"""Cost model golden values (docs/METHODS.md §6) and the skip break-even (§7, eq. 8)."""

from __future__ import annotations

import math

import pytest

from vllm_prove.core import (
    LOSSLESS_CYCLE_COST,
    break_even_skip_length,
    ideal_speedup,
    lossless_cycle_cost,
    prove_cycle_cost,
    rho_from_pass_times,
    sd_cycle_cost,
)

# Paper pass times, two GPUs (ProVe appendix A), ms.
AR_MS, WINDOW_MS, VERIFIER_3B_MS, LOSSLESS_OVERHEAD_MS = 14.8, 15.6, 5.0, 8.7


def test_lossless_ideal_speedup_at_block_16():
    # lossless commits 7.5 tokens per cycle at B = 16; two passes per cycle -> 3.75x
    assert LOSSLESS_CYCLE_COST == 2.0
    assert ideal_speedup(7.5, LOSSLESS_CYCLE_COST) == pytest.approx(3.75)
    assert ideal_speedup(7.5, lossless_cycle_cost()) == pytest.approx(3.75)


def test_lossless_speedup_with_measured_costs():
    # 7.5 tokens per (2 x 15.6 + 8.7) ms against 14.8 ms per AR token
    overhead = LOSSLESS_OVERHEAD_MS / WINDOW_MS
    got = ideal_speedup(7.5, lossless_cycle_cost(overhead), ar_pass_cost=AR_MS / WINDOW_MS)
    assert got == pytest.approx(7.5 * 14.8 / 39.9)
    assert got == pytest.approx(2.782, abs=1e-3)


def test_prove_and_sd_cycle_costs():
    rho = rho_from_pass_times(VERIFIER_3B_MS, WINDOW_MS)
    assert rho == pytest.approx(0.3205, abs=1e-4)
    assert prove_cycle_cost(rho) == pytest.approx(1.3205, abs=1e-4)
    assert prove_cycle_cost(0.5, overhead=0.25) == 1.75
    assert ideal_speedup(6.0, prove_cycle_cost(0.5)) == pytest.approx(4.0)
    assert sd_cycle_cost(5, 0.2) == pytest.approx(2.0)
    assert sd_cycle_cost(3, 0.2, overhead=0.1) == pytest.approx(1.7)
    assert ideal_speedup(1.0, 1.0) == 1.0  # AR against itself


def test_break_even_skip_length():
    assert break_even_skip_length(10.0, 1.0, 3.0) == pytest.approx(2.5)
    # a free verifier makes every skip shorter than a strict round a loss
    assert break_even_skip_length(8.0, 1.0, 1e-9) == pytest.approx(8.0)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: ideal_speedup(0.5, 2.0), "committed_per_cycle"),
        (lambda: ideal_speedup(2.0, 0.0), "cycle_cost"),
        (lambda: ideal_speedup(2.0, 1.0, ar_pass_cost=-1.0), "ar_pass_cost"),
        (lambda: prove_cycle_cost(-0.1), "rho"),
        (lambda: prove_cycle_cost(0.3, overhead=-1.0), "overhead"),
        (lambda: sd_cycle_cost(0, 0.2), "k"),
        (lambda: sd_cycle_cost(3, math.nan), "rho"),
        (lambda: lossless_cycle_cost(math.inf), "overhead"),
        (lambda: rho_from_pass_times(5.0, 0.0), "proposer_pass_s"),
        (lambda: break_even_skip_length(10.0, 0.0, 1.0), "c_D"),
        (lambda: break_even_skip_length(10.0, 1.0, -1.0), "c_V"),
        (lambda: break_even_skip_length(0.0, 1.0, 1.0), "A"),
    ],
)
def test_invalid_costs_raise_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()
