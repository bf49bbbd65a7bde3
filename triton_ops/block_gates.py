"""Gate a ragged batch of draft blocks to an accepted length, written in vLLM's output layout.

Input layout (vLLM ``v1/spec_decode/metadata.py``): the draft tokens of all requests are
flattened into ``[num_tokens]``; request ``r`` owns ``[cu_num_draft_tokens[r-1],
cu_num_draft_tokens[r])`` (``cu_num_draft_tokens`` is the inclusive cumulative sum, no
leading zero). Output layout (``RejectionSampler.forward``): ``[batch, max_spec_len + 1]``
token ids, the emitted tokens first, padded with ``PLACEHOLDER_TOKEN_ID``::

    request r, n = 4 drafts, a = 2 accepted   output row r
    draft  y1 y2 y3 y4                       y1 y2 g3 -1 -1      (lossless: g3 recovered)
                                             y1 y2 -1 -1 -1      (product gate: nothing more)

One program per request row loads its whole slice (``BLOCK >= max_spec_len + 1`` lanes) and
finds the first failing position with a ``min`` reduction; there is no per-token loop.
The torch twins (``vllm_prove.core.fused``) scatter the same slices into the padded
``BlockProposal`` layout and call ``vllm_prove.core.rules``, so the kernel-vs-twin tests also
prove the kernels agree with the acceptance rules.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_prove.core.contracts import PLACEHOLDER_TOKEN_ID, Verdict

_PLACEHOLDER = tl.constexpr(PLACEHOLDER_TOKEN_ID)
# y_1 is the proposer's ordinary AR token: ProVe always commits it (docs/METHODS.md §3).
_ALWAYS_COMMITTED = tl.constexpr(1)


@triton.jit
def _row_slice(cu_num_draft_tokens_ptr, req):
    """``(start, n)`` of request ``req`` in the flat ``[num_tokens]`` layout."""
    end = tl.load(cu_num_draft_tokens_ptr + req).to(tl.int64)
    start = tl.load(cu_num_draft_tokens_ptr + req - 1, mask=req > 0, other=0).to(tl.int64)
    return start, end - start


@triton.jit
def _first_failure(failed, pos, n, BLOCK: tl.constexpr):
    """Number of leading positions < n that did not fail: the accepted prefix length."""
    first = tl.min(tl.where(failed, pos, BLOCK), axis=0)
    return tl.minimum(first, n)


# max_spec_len only sizes the output rows: no recompilation per value (as in vLLM).
@triton.jit(do_not_specialize=["max_spec_len"])
def product_gate_kernel(
    output_token_ids_ptr,  # [batch, max_spec_len + 1] int64, out
    num_accepted_ptr,  # [batch] int64, out
    cu_num_draft_tokens_ptr,  # [batch]
    draft_token_ids_ptr,  # [num_tokens]
    proposer_probs_ptr,  # [num_tokens]: p~_i
    verifier_probs_ptr,  # [num_tokens]: q_i
    theta,
    max_spec_len,
    BLOCK: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    start, n = _row_slice(cu_num_draft_tokens_ptr, req)
    pos = tl.arange(0, BLOCK).to(tl.int64)
    valid = pos < n
    p = tl.load(proposer_probs_ptr + start + pos, mask=valid, other=0.0).to(tl.float32)
    q = tl.load(verifier_probs_ptr + start + pos, mask=valid, other=0.0).to(tl.float32)
    # s_i >= theta, written as "not failed" so a NaN score fails like in torch.
    failed = valid & ~(p * q >= theta) & (pos >= _ALWAYS_COMMITTED)
    a = _first_failure(failed, pos, n, BLOCK)
    keep = pos < a
    draft = tl.load(draft_token_ids_ptr + start + pos, mask=keep, other=_PLACEHOLDER)
    out = tl.where(keep, draft.to(tl.int64), _PLACEHOLDER)
    tl.store(output_token_ids_ptr + req * (max_spec_len + 1) + pos, out, mask=pos <= max_spec_len)
    tl.store(num_accepted_ptr + req, a)


@triton.jit(do_not_specialize=["max_spec_len"])
def lossless_greedy_kernel(
    output_token_ids_ptr,  # [batch, max_spec_len + 1] int64, out
    num_accepted_ptr,  # [batch] int64, out
    cu_num_draft_tokens_ptr,  # [batch]
    draft_token_ids_ptr,  # [num_tokens]: y_i
    target_token_ids_ptr,  # [num_tokens]: g_i, the verifier's argmax at each draft position
    bonus_token_ids_ptr,  # [batch]: g_{n+1}
    max_spec_len,
    BLOCK: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    start, n = _row_slice(cu_num_draft_tokens_ptr, req)
    pos = tl.arange(0, BLOCK).to(tl.int64)
    valid = pos < n
    draft = tl.load(draft_token_ids_ptr + start + pos, mask=valid, other=0).to(tl.int64)
    target = tl.load(target_token_ids_ptr + start + pos, mask=valid, other=0).to(tl.int64)
    a = _first_failure(valid & (draft != target), pos, n, BLOCK)
    # g_{a+1}: recovered at the first mismatch (a < n), bonus when all n matched (a == n).
    recovered = tl.load(target_token_ids_ptr + start + a, mask=a < n, other=0).to(tl.int64)
    bonus = tl.load(bonus_token_ids_ptr + req).to(tl.int64)
    extra = tl.where(a < n, recovered, bonus)
    out = tl.where(pos < a, draft, tl.where(pos == a, extra, _PLACEHOLDER))
    tl.store(output_token_ids_ptr + req * (max_spec_len + 1) + pos, out, mask=pos <= max_spec_len)
    tl.store(num_accepted_ptr + req, a)


def _check_ragged(
    # [batch]
    cu_num_draft_tokens: torch.Tensor,
    # [num_tokens] each
    *flat: torch.Tensor,
) -> None:
    if cu_num_draft_tokens.dim() != 1:
        raise ValueError(f"cu_num_draft_tokens must be [batch], got {tuple(cu_num_draft_tokens.shape)}")
    num_tokens = flat[0].shape[0]
    for tensor in flat:
        if tensor.dim() != 1 or tensor.shape[0] != num_tokens:
            raise ValueError(f"flat inputs must all be [num_tokens={num_tokens}], got {tuple(tensor.shape)}")


def _outputs(
    batch: int, max_spec_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:  # [batch, max_spec_len + 1] int64, [batch] int64
    # Every entry is written by the kernel (placeholders included), so no fill is needed.
    output_token_ids = torch.empty((batch, max_spec_len + 1), dtype=torch.int64, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)  # [batch]
    return output_token_ids, num_accepted


def product_gate(
    # [num_tokens] integer: y_i
    draft_token_ids: torch.Tensor,
    # [num_tokens] float: p~_i
    proposer_probs: torch.Tensor,
    # [num_tokens] float: q_i
    verifier_probs: torch.Tensor,
    # [batch] integer: inclusive cumulative draft counts
    cu_num_draft_tokens: torch.Tensor,
    theta: float,
    max_spec_len: int,
) -> Verdict:
    """ProVe's product gate on a ragged batch; see ``vllm_prove.core.rules.product_gate``."""
    _check_ragged(cu_num_draft_tokens, draft_token_ids, proposer_probs, verifier_probs)
    batch = cu_num_draft_tokens.shape[0]
    output_token_ids, num_accepted = _outputs(batch, max_spec_len, draft_token_ids.device)
    if batch > 0:
        product_gate_kernel[(batch,)](
            output_token_ids, num_accepted, cu_num_draft_tokens, draft_token_ids.contiguous(),
            proposer_probs.contiguous(), verifier_probs.contiguous(), theta, max_spec_len,
            BLOCK=triton.next_power_of_2(max_spec_len + 1),
        )
    # Nothing the verifier predicts is emitted: every emitted token is an accepted draft.
    return Verdict(num_accepted, output_token_ids, num_accepted.clone())


def lossless_greedy(
    # [num_tokens] integer: y_i
    draft_token_ids: torch.Tensor,
    # [num_tokens] integer: g_i, the verifier's argmax at each draft position
    target_token_ids: torch.Tensor,
    # [batch] or [batch, 1] integer: g_{n+1}
    bonus_token_ids: torch.Tensor,
    # [batch] integer: inclusive cumulative draft counts
    cu_num_draft_tokens: torch.Tensor,
    max_spec_len: int,
) -> Verdict:
    """Greedy verification on a ragged batch; see ``vllm_prove.core.rules.lossless_greedy``."""
    _check_ragged(cu_num_draft_tokens, draft_token_ids, target_token_ids)
    batch = cu_num_draft_tokens.shape[0]
    bonus_token_ids = bonus_token_ids.reshape(-1).contiguous()  # [batch]
    if bonus_token_ids.shape[0] != batch:
        raise ValueError(f"bonus_token_ids must hold {batch} tokens, got {bonus_token_ids.shape[0]}")
    output_token_ids, num_accepted = _outputs(batch, max_spec_len, draft_token_ids.device)
    if batch > 0:
        lossless_greedy_kernel[(batch,)](
            output_token_ids, num_accepted, cu_num_draft_tokens, draft_token_ids.contiguous(),
            target_token_ids.contiguous(), bonus_token_ids, max_spec_len,
            BLOCK=triton.next_power_of_2(max_spec_len + 1),
        )
    # Exactly one verifier token (recovered or bonus) follows the accepted prefix.
    return Verdict(num_accepted, output_token_ids, num_accepted + 1)
