"""One-pass reductions over the vocabulary: top-1 confidence and the probability of a token.

Both read each logit exactly once and never materialize a softmax: one program per row walks
the vocabulary in ``BLOCK_V`` chunks and keeps an online maximum ``m`` and a running sum
``s = sum_v exp(z_v - m)``, rescaled whenever ``m`` grows (Milakov & Gimelshein 2018,
"Online normalizer calculation for softmax", arXiv:1805.02867). Accumulation is fp32 for any
input dtype, so bf16 logits give the same numbers as their fp32 upcast.

Conventions shared with the torch twins in ``vllm_prove/core/fused.py``:
- argmax ties resolve to the LOWEST vocabulary index (what ``torch.argmax`` returns);
- a token whose logit is ``-inf`` has probability exactly 0;
- a row whose logits are all ``-inf`` has no distribution: its argmax is 0 and its
  probabilities are NaN, as ``torch.softmax`` gives (so downstream validity guards see it).
``+inf`` and NaN logits are outside the contract.

The launchers take CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1`` was set before
this module was imported (``triton.jit`` reads it at decoration time).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Chunk of the vocabulary one program loads per step: 152,064 / 4,096 = 38 steps per row.
# Large enough to keep many loads in flight per SM; small enough to stay in registers.
DEFAULT_BLOCK_V = 4096
# 8 warps x 32 lanes x 16 elements = one 4,096-wide chunk per step.
DEFAULT_NUM_WARPS = 8
# Index larger than any vocabulary position; ``min`` over it means "no such position".
_NO_INDEX = tl.constexpr(2**31 - 1)


@triton.jit
def _finite_or_zero(m):
    # exp(-inf - (-inf)) is NaN; while the running max is -inf every term is 0 anyway.
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _rescaled_sum(s, m, new_m, x):
    """``s * exp(m - new_m) + sum(exp(x - new_m))``, safe while every value seen is -inf."""
    safe_m = _finite_or_zero(new_m)
    return s * tl.exp(m - safe_m) + tl.sum(tl.exp(x - safe_m), axis=0)


@triton.jit
def _normalizer(s, m):
    """The softmax denominator ``s``, or NaN for a row with no finite logit (then s = 0)."""
    return tl.where(m == float("-inf"), float("nan"), s)


@triton.jit
def top1_confidence_kernel(
    logits_ptr,  # [num_tokens, vocab], any float dtype
    token_ids_ptr,  # [num_tokens] int64, out: argmax
    probs_ptr,  # [num_tokens] float32, out: max softmax probability
    vocab_size,
    logits_row_stride,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    offs = tl.arange(0, BLOCK_V)
    m = tl.full([], float("-inf"), tl.float32)  # running max
    s = tl.zeros([], tl.float32)  # sum of exp(z - m) so far
    best = tl.zeros([], tl.int32)  # lowest index of the running max
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + offs
        valid = cols < vocab_size
        x = tl.load(row_ptr + cols, mask=valid, other=float("-inf")).to(tl.float32)
        chunk_max = tl.max(x, axis=0)
        chunk_best = tl.min(tl.where(valid & (x == chunk_max), cols, _NO_INDEX), axis=0)
        # Strictly greater: an equal maximum in a later chunk has a higher index and loses.
        best = tl.where(chunk_max > m, chunk_best, best)
        new_m = tl.maximum(m, chunk_max)
        s = _rescaled_sum(s, m, new_m, x)
        m = new_m
    # The maximum contributes exp(0) = 1 to s, so its probability is 1 / s.
    prob = 1.0 / _normalizer(s, m)
    tl.store(token_ids_ptr + row, best.to(tl.int64))
    tl.store(probs_ptr + row, prob)


@triton.jit
def token_prob_kernel(
    logits_ptr,  # [num_tokens, vocab], any float dtype
    token_ids_ptr,  # [num_tokens] integer: the token y_i whose probability is read
    probs_ptr,  # [num_tokens] float32, out: softmax(logits_i)[y_i]
    vocab_size,
    logits_row_stride,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    offs = tl.arange(0, BLOCK_V)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + offs
        x = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        s = _rescaled_sum(s, m, new_m, x)
        m = new_m
    token = tl.load(token_ids_ptr + row).to(tl.int64)
    z = tl.load(row_ptr + token).to(tl.float32)
    # q = exp(z - logsumexp) = exp(z - m) / s: exactly 0 when z is -inf and m finite;
    # NaN when the whole row is -inf.
    prob = tl.exp(z - _finite_or_zero(m)) / _normalizer(s, m)
    tl.store(probs_ptr + row, prob)


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_tokens, vocab], got {tuple(logits.shape)}")
    if logits.stride(-1) != 1:
        raise ValueError("logits must be contiguous along the vocabulary")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")


def top1_confidence(
    # [num_tokens, vocab]
    logits: torch.Tensor,
    block_v: int = DEFAULT_BLOCK_V,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Argmax and max softmax probability per row, in one pass over the logits.

    Returns ``token_ids`` ``[num_tokens]`` int64 and ``probs`` ``[num_tokens]`` float32.
    """
    _check_logits(logits)
    num_tokens, vocab_size = logits.shape
    token_ids = torch.empty(num_tokens, dtype=torch.int64, device=logits.device)  # [num_tokens]
    probs = torch.empty(num_tokens, dtype=torch.float32, device=logits.device)  # [num_tokens]
    if num_tokens == 0:
        return token_ids, probs
    block_v = min(block_v, triton.next_power_of_2(vocab_size))
    top1_confidence_kernel[(num_tokens,)](
        logits, token_ids, probs, vocab_size, logits.stride(0), BLOCK_V=block_v,
        num_warps=num_warps,
    )
    return token_ids, probs


def token_prob(
    # [num_tokens, vocab]
    logits: torch.Tensor,
    # [num_tokens] integer
    token_ids: torch.Tensor,
    block_v: int = DEFAULT_BLOCK_V,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> torch.Tensor:
    """``softmax(logits_i)[token_ids_i]`` per row, one pass; returns ``[num_tokens]`` float32.

    Token ids are not range-checked here (that would sync with the device); the dispatcher in
    ``vllm_prove.core.fused`` documents the contract.
    """
    _check_logits(logits)
    num_tokens, vocab_size = logits.shape
    if token_ids.shape != (num_tokens,):
        raise ValueError(f"token_ids must be [{num_tokens}], got {tuple(token_ids.shape)}")
    probs = torch.empty(num_tokens, dtype=torch.float32, device=logits.device)  # [num_tokens]
    if num_tokens == 0:
        return probs
    block_v = min(block_v, triton.next_power_of_2(vocab_size))
    token_prob_kernel[(num_tokens,)](
        logits, token_ids.contiguous(), probs, vocab_size, logits.stride(0), BLOCK_V=block_v,
        num_warps=num_warps,
    )
    return probs
