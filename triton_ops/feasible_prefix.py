"""Skip-policy feasible prefix ``K^`` per row of a ragged batch (docs/METHODS.md §7).

``K^ = max{k <= n : B_k >= eta_b and C_k >= eta_c}`` (0 if none), with the local gate
``B_k = min_{j<=k} q_j`` and the prefix gate ``C_k`` one of: ``min_{j<=k} q_j``, the product
``prod_{j<=k} q_j`` compared in log space (``sum log q_j >= log eta_c``), or the geometric
mean, also in log space (``sum log q_j / k >= log eta_c``). The twin is ``vllm_prove.core.skip_policy.feasible_prefix``
(through ``vllm_prove.core.fused.feasible_prefix_ragged``); like it, the kernel works in
float64, so log-space sums agree with it except exactly on a threshold (the GPU scan adds in
a different order than the CPU's sequential cumsum).

One program per request row loads the row's scores at once and takes prefix minima and
prefix log-sums with scans; a NaN score fails the local gate at its position and after.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from vllm_prove.core.skip_policy import NO_FEASIBLE_PREFIX, PrefixGate, prefix_threshold

# Compile-time codes of the prefix gates (a registry, not string dispatch inside the kernel).
_GATE_MIN = tl.constexpr(0)
_GATE_PRODUCT = tl.constexpr(1)
_GATE_GEOMETRIC_MEAN = tl.constexpr(2)
GATE_CODES: dict[PrefixGate, int] = {
    PrefixGate.MIN: _GATE_MIN.value,
    PrefixGate.PRODUCT: _GATE_PRODUCT.value,
    PrefixGate.GEOMETRIC_MEAN: _GATE_GEOMETRIC_MEAN.value,
}
_NO_FEASIBLE_PREFIX = tl.constexpr(NO_FEASIBLE_PREFIX)


@triton.jit
def _minimum(a, b):
    return tl.minimum(a, b)


@triton.jit
def feasible_prefix_kernel(
    k_hat_ptr,  # [batch] int64, out: K^
    cu_num_draft_tokens_ptr,  # [batch]
    scores_ptr,  # [num_tokens]: q_j
    thresholds_ptr,  # [2] float64: eta_b, then eta_c (log eta_c for the product gate)
    PREFIX_GATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    end = tl.load(cu_num_draft_tokens_ptr + req).to(tl.int64)
    start = tl.load(cu_num_draft_tokens_ptr + req - 1, mask=req > 0, other=0).to(tl.int64)
    n = end - start
    eta_b = tl.load(thresholds_ptr)
    eta_c_cmp = tl.load(thresholds_ptr + 1)
    pos = tl.arange(0, BLOCK).to(tl.int64)
    valid = pos < n
    # Padding lanes sit after every valid one, so they never change a valid prefix.
    q = tl.load(scores_ptr + start + pos, mask=valid, other=1.0).to(tl.float64)
    # NaN -> -inf before the prefix minimum, so a NaN fails B_k from its position on.
    local = tl.associative_scan(tl.where(q != q, float("-inf"), q), 0, _minimum)
    if PREFIX_GATE == _GATE_MIN:
        prefix = tl.associative_scan(q, 0, _minimum)
    else:
        # log 0 = -inf (fails unless eta_c = 0); log of a negative score is NaN (fails).
        prefix = tl.cumsum(tl.log(q), 0)
        if PREFIX_GATE == _GATE_GEOMETRIC_MEAN:
            prefix = prefix / (pos + 1).to(tl.float64)  # log of the geometric mean
    feasible = valid & (local >= eta_b) & (prefix >= eta_c_cmp)
    k_hat = tl.max(tl.where(feasible, pos + 1, _NO_FEASIBLE_PREFIX), axis=0)
    tl.store(k_hat_ptr + req, k_hat)


def feasible_prefix(
    # [num_tokens] float: q_j of every row, flat
    scores: torch.Tensor,
    # [batch] integer: inclusive cumulative draft counts
    cu_num_draft_tokens: torch.Tensor,
    eta_b: float,
    eta_c: float,
    prefix_gate: PrefixGate | str,
    max_spec_len: int,
) -> torch.Tensor:  # [batch] int64: K^
    """``K^`` per row; ``max_spec_len`` bounds every row's draft count (sizes the lanes)."""
    gate = PrefixGate(prefix_gate)
    if scores.dim() != 1 or cu_num_draft_tokens.dim() != 1:
        raise ValueError("scores must be [num_tokens] and cu_num_draft_tokens [batch]")
    batch = cu_num_draft_tokens.shape[0]
    k_hat = torch.empty(batch, dtype=torch.int64, device=scores.device)  # [batch]
    if batch == 0:
        return k_hat
    eta_c_cmp = prefix_threshold(gate, eta_c)  # the twin's own threshold, bit for bit
    # A tensor, not Python floats: Triton passes a float argument as float32, and the twin
    # compares float64 scores with float64 thresholds.
    thresholds = torch.tensor([eta_b, eta_c_cmp], dtype=torch.float64).to(scores.device)  # [2]
    feasible_prefix_kernel[(batch,)](
        k_hat, cu_num_draft_tokens, scores.contiguous(), thresholds,
        PREFIX_GATE=GATE_CODES[gate], BLOCK=max(triton.next_power_of_2(max_spec_len), 1),
    )
    return k_hat
