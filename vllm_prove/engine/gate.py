"""The gated modes' cycle on vLLM's flat layout (pure torch: no vLLM import).

In the gated modes (ProVe with a verifier, docs/METHODS.md §3; MARS, §5) vLLM's "drafts" are
``B - 1`` mask placeholders, so the target pass over a request's scheduled tokens
``[catch-up..., u, mask x (B-1)]`` *is* the proposer's window pass. Its logits rows, in
vLLM's spec-decode layout (``SpecDecodeMetadata.logits_indices``: ``n + 1`` rows per request
with ``n`` drafts), give the block::

    row:      u      mask_1   ...   mask_{B-1}
    output:   y_1    y_2      ...   y_B           p~_i = max softmax of that row

The verifier reads the same tokens with each mask replaced by the proposal before it
(``u, y_1 .. y_{B-1}``), so its row ``i`` scores ``q_i = P_V(y_i | x, y_<i)``. The core's gate
then commits ``y_1..y_a``; nothing the verifier predicts is emitted. Every function here
calls ``vllm_prove.core`` for the math (Triton kernels on CUDA, torch twins elsewhere).
"""

from __future__ import annotations

import torch

from vllm_prove.core import fused, rules
from vllm_prove.core.contracts import PLACEHOLDER_TOKEN_ID, BlockProposal, Verdict
from vllm_prove.core.rules import GateKind

# Padding of the padded [batch, block] layout (never read by a rule: past num_draft_tokens).
PAD_TOKEN_ID = PLACEHOLDER_TOKEN_ID
PAD_PROB = fused.PAD_PROB


def propose_from_window(
    # [num_rows, vocab]: the window logits, rows in SpecDecodeMetadata.logits_indices order
    logits: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_rows] int64 y_i, [num_rows] float32 p~_i
    """The block and its confidences (docs/METHODS.md §1): argmax and max softmax per row."""
    return fused.top1_confidence(logits)


def verifier_input_ids(
    # [num_scheduled_tokens]: the step's input ids (masks at the draft positions)
    input_ids: torch.Tensor,
    # [num_rows] int64: y_i per logits row
    draft_token_ids: torch.Tensor,
    # [num_rows]: token index of each logits row (SpecDecodeMetadata.logits_indices)
    logits_indices: torch.Tensor,
    # [num_draft_tokens]: logits row *before* each draft (SpecDecodeMetadata.target_logits_indices)
    target_logits_indices: torch.Tensor,
) -> torch.Tensor:  # [num_scheduled_tokens]: masks replaced by y_1..y_{B-1}
    """The verifier's teacher-forced input: mask ``j`` (row ``r + 1``) becomes ``y`` of row ``r``."""
    rows = target_logits_indices.long()  # [num_draft_tokens]
    ids = input_ids.clone()
    ids[logits_indices.long()[rows + 1]] = draft_token_ids[rows].to(ids.dtype)
    return ids


def apply_window_gate(
    kind: GateKind,
    threshold: float,
    # [num_rows] int64: y_i, requests back to back
    draft_token_ids: torch.Tensor,
    # [num_rows] float32: p~_i
    proposer_probs: torch.Tensor,
    # [num_rows] float32 or None: q_i (None only for the proposer-only gate)
    verifier_probs: torch.Tensor | None,
    # [batch] int: inclusive cumulative block lengths (SpecDecodeMetadata.cu_num_sampled_tokens)
    cu_num_sampled_tokens: torch.Tensor,
    max_block: int,
) -> Verdict:  # output_token_ids [batch, max_block + 1]
    """Commit ``y_1..y_a`` per request with the core's gate ``kind`` (docs/METHODS.md §3, §5). Lossy.

    The product gate runs ``fused.product_gate_ragged`` (the Triton kernel on CUDA); the other
    kinds scatter to the padded layout and call ``rules.apply_gate``. Rows hold 1..max_block
    tokens; ``y_1`` is always committed.
    """
    if kind is GateKind.PRODUCT:
        if verifier_probs is None:
            raise RuntimeError("the product gate needs the verifier's probabilities q_i; none were computed")
        return fused.product_gate_ragged(
            draft_token_ids, proposer_probs, verifier_probs, cu_num_sampled_tokens, threshold, max_block
        )
    drafts, num_tokens = fused.ragged_to_padded(draft_token_ids.long(), cu_num_sampled_tokens, max_block, PAD_TOKEN_ID)
    p_tilde, _ = fused.ragged_to_padded(proposer_probs.float(), cu_num_sampled_tokens, max_block, PAD_PROB)
    q = None
    if verifier_probs is not None:
        q, _ = fused.ragged_to_padded(verifier_probs.float(), cu_num_sampled_tokens, max_block, PAD_PROB)
    return rules.apply_gate(kind, BlockProposal(drafts, p_tilde, num_tokens), q, threshold)


def sampled_token_ids(
    verdict: Verdict,
    max_spec_len: int,
) -> torch.Tensor:  # [batch, max_spec_len + 1] int32, PLACEHOLDER_TOKEN_ID-padded
    """The verdict in ``SamplerOutput.sampled_token_ids`` layout (``vllm/v1/outputs.py:205``).

    A gate emits only accepted tokens (``a <= max_spec_len + 1``), so the verdict's extra
    column, reserved for a recovered/bonus token, is always padding and is dropped.
    """
    return verdict.output_token_ids[:, : max_spec_len + 1].to(torch.int32)
