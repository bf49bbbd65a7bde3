"""The acceptance math on serving-sized tensors: Triton kernels on CUDA, torch twins elsewhere.

Each public function takes a ``backend``: ``auto`` (the default) runs the Triton kernel from
``triton_ops`` when the tensors live on CUDA and Triton is installed, and the pure-torch twin
otherwise; ``torch`` and ``triton`` force one side (tests force ``triton`` on CPU tensors
under ``TRITON_INTERPRET=1``). ``triton_ops`` is imported lazily, so the core imports and
runs without Triton.

- ``top1_confidence``: argmax and max softmax probability per row of ``[num_tokens, vocab]``
  logits: the proposer's block ``y_i`` and its confidence ``p~_i`` (docs/METHODS.md §1).
- ``token_prob``: ``q_i = softmax(logits_i)[y_i]``, the teacher-forced verifier probability
  (docs/METHODS.md §3).
- ``product_gate_ragged`` / ``lossless_greedy_ragged``: ProVe's product gate (lossy) and
  greedy verification (lossless) over vLLM's flat ragged draft layout
  (``cu_num_draft_tokens``), written in vLLM's ``[batch, max_spec_len + 1]`` output layout.
- ``feasible_prefix_ragged``: the verifier-skipping feasible prefix ``K^`` (docs/METHODS.md §7).

The vocabulary twins define the conventions the kernels match: fp32 arithmetic for any
input dtype; argmax ties go to the lowest index (``torch.argmax``); a token whose logit is
``-inf`` has probability 0; a row that is all ``-inf`` gets argmax 0 and probability NaN.
The ragged twins hold no acceptance logic of their own: they scatter the flat layout into
the padded ``BlockProposal`` layout and call ``vllm_prove.core.rules`` and
``vllm_prove.core.skip_policy``, so kernel-vs-twin equality is equality with the rules.
"""

from __future__ import annotations

import enum
import functools
import importlib
import importlib.util
import os

import torch

from vllm_prove.core import rules, skip_policy
from vllm_prove.core.contracts import PLACEHOLDER_TOKEN_ID, BlockProposal, Verdict
from vllm_prove.core.skip_policy import PrefixGate

# Padding for float inputs scattered into the padded layout; no rule reads padded positions.
PAD_PROB = 0.0


class Backend(str, enum.Enum):
    """Which implementation runs the math."""

    AUTO = "auto"  # Triton on CUDA tensors when Triton is installed, torch otherwise
    TORCH = "torch"  # the pure-torch twin, any device
    TRITON = "triton"  # the kernel: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _use_triton(backend: Backend | str, tensor: torch.Tensor) -> bool:
    backend = Backend(backend)
    if backend is Backend.AUTO:
        return tensor.is_cuda and _triton_installed()
    if backend is Backend.TRITON and not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before Triton "
            f"is imported; got tensors on {tensor.device}"
        )
    return backend is Backend.TRITON


def _kernels(module: str):
    """``triton_ops.<module>``, imported on first use so the core never requires Triton."""
    return importlib.import_module(f"triton_ops.{module}")


def _check_unit_interval(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:  # also rejects NaN
        raise ValueError(f"{name} must lie in [0, 1], got {value}")


# ---------------------------------------------------------------- vocabulary reductions


def top1_confidence_torch(
    # [num_tokens, vocab]
    logits: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens] int64, [num_tokens] float32
    """Twin of ``triton_ops.vocab_reductions.top1_confidence_kernel``."""
    x = logits.float()  # [num_tokens, vocab]
    max_logit, token_ids = x.max(dim=-1)  # [num_tokens] each; ties -> lowest index
    # max softmax = exp(max - logsumexp); an all -inf row gives -inf - -inf = NaN.
    probs = torch.exp(max_logit - torch.logsumexp(x, dim=-1))  # [num_tokens]
    return token_ids, probs


def top1_confidence(
    # [num_tokens, vocab]
    logits: torch.Tensor,
    backend: Backend | str = Backend.AUTO,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens] int64, [num_tokens] float32
    """Argmax ``y_i`` and max softmax probability ``p~_i`` per row, without a softmax tensor."""
    if _use_triton(backend, logits):
        return _kernels("vocab_reductions").top1_confidence(logits)
    return top1_confidence_torch(logits)


def token_prob_torch(
    # [num_tokens, vocab]
    logits: torch.Tensor,
    # [num_tokens] integer, each in [0, vocab)
    token_ids: torch.Tensor,
) -> torch.Tensor:  # [num_tokens] float32
    """Twin of ``triton_ops.vocab_reductions.token_prob_kernel``."""
    x = logits.float()  # [num_tokens, vocab]
    z = x.gather(-1, token_ids.long()[:, None])[:, 0]  # [num_tokens]
    return torch.exp(z - torch.logsumexp(x, dim=-1))


def token_prob(
    # [num_tokens, vocab]
    logits: torch.Tensor,
    # [num_tokens] integer, each in [0, vocab): not range-checked on the kernel path
    token_ids: torch.Tensor,
    backend: Backend | str = Backend.AUTO,
) -> torch.Tensor:  # [num_tokens] float32
    """``q_i = softmax(logits_i)[token_ids_i]`` per row, one pass (online logsumexp)."""
    if _use_triton(backend, logits):
        return _kernels("vocab_reductions").token_prob(logits, token_ids)
    return token_prob_torch(logits, token_ids)


# ---------------------------------------------------------------- ragged blocks


def num_draft_tokens_from_cu(
    # [batch] integer: inclusive cumulative draft counts (vLLM, no leading zero)
    cu_num_draft_tokens: torch.Tensor,
) -> torch.Tensor:  # [batch] int64
    """Per-request draft counts from vLLM's ``cu_num_draft_tokens``."""
    cu = cu_num_draft_tokens.long()  # [batch]
    return torch.diff(cu, prepend=cu.new_zeros(1))


def ragged_to_padded(
    # [num_tokens]: the rows' values back to back
    flat: torch.Tensor,
    # [batch] integer
    cu_num_draft_tokens: torch.Tensor,
    max_spec_len: int,
    pad_value: float | int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [batch, max_spec_len], [batch] int64
    """Scatter vLLM's flat per-token layout into ``[batch, max_spec_len]`` rows."""
    num_draft_tokens = num_draft_tokens_from_cu(cu_num_draft_tokens)  # [batch]
    starts = cu_num_draft_tokens.long() - num_draft_tokens  # [batch]
    positions = torch.arange(max_spec_len, device=flat.device)  # [max_spec_len]
    valid = positions[None, :] < num_draft_tokens[:, None]  # [batch, max_spec_len]
    # One trailing pad element makes every index valid, even for an empty batch.
    padded_flat = torch.cat([flat, flat.new_full((1,), pad_value)])  # [num_tokens + 1]
    index = torch.where(valid, starts[:, None] + positions, flat.shape[0])  # [batch, max_spec_len]
    return padded_flat[index], num_draft_tokens


def product_gate_ragged_torch(
    # [num_tokens] integer: y_i
    draft_token_ids: torch.Tensor,
    # [num_tokens] float: p~_i
    proposer_probs: torch.Tensor,
    # [num_tokens] float: q_i
    verifier_probs: torch.Tensor,
    # [batch] integer
    cu_num_draft_tokens: torch.Tensor,
    theta: float,
    max_spec_len: int,
) -> Verdict:
    """Twin of ``triton_ops.block_gates.product_gate_kernel``: ``rules.product_gate``."""
    cu, length = cu_num_draft_tokens, max_spec_len
    drafts, num_draft_tokens = ragged_to_padded(draft_token_ids.long(), cu, length, PLACEHOLDER_TOKEN_ID)
    p, _ = ragged_to_padded(proposer_probs.float(), cu, length, PAD_PROB)  # [batch, max_spec_len]
    q, _ = ragged_to_padded(verifier_probs.float(), cu, length, PAD_PROB)  # [batch, max_spec_len]
    return rules.product_gate(BlockProposal(drafts, p, num_draft_tokens), q, theta)


def product_gate_ragged(
    # [num_tokens] integer: y_i, all requests back to back
    draft_token_ids: torch.Tensor,
    # [num_tokens] float: p~_i
    proposer_probs: torch.Tensor,
    # [num_tokens] float: q_i
    verifier_probs: torch.Tensor,
    # [batch] integer: inclusive cumulative draft counts
    cu_num_draft_tokens: torch.Tensor,
    theta: float,
    max_spec_len: int,
    backend: Backend | str = Backend.AUTO,
) -> Verdict:  # output_token_ids [batch, max_spec_len + 1]
    """ProVe's product gate (docs/METHODS.md §3; ProVe §3.2) on a ragged batch. Lossy.

    ``s_i = p~_i * q_i`` in fp32; commit ``y_1..y_a`` with
    ``a = max{a : s_i >= theta for every 2 <= i <= a}``; ``y_1`` is always committed and no
    verifier token is emitted. Rows hold ``0..max_spec_len`` drafts.
    """
    _check_unit_interval("theta", theta)
    args = (draft_token_ids, proposer_probs, verifier_probs, cu_num_draft_tokens, theta, max_spec_len)
    if _use_triton(backend, verifier_probs):
        return _kernels("block_gates").product_gate(*args)
    return product_gate_ragged_torch(*args)


def lossless_greedy_ragged_torch(
    # [num_tokens] integer: y_i
    draft_token_ids: torch.Tensor,
    # [num_tokens] integer: g_i
    target_token_ids: torch.Tensor,
    # [batch] or [batch, 1] integer: g_{n+1}
    bonus_token_ids: torch.Tensor,
    # [batch] integer
    cu_num_draft_tokens: torch.Tensor,
    max_spec_len: int,
) -> Verdict:
    """Twin of ``triton_ops.block_gates.lossless_greedy_kernel``: ``rules.lossless_greedy``."""
    cu, length = cu_num_draft_tokens, max_spec_len
    drafts, num_draft_tokens = ragged_to_padded(draft_token_ids.long(), cu, length, PLACEHOLDER_TOKEN_ID)
    targets, _ = ragged_to_padded(target_token_ids.long(), cu, length, PLACEHOLDER_TOKEN_ID)
    # g_1..g_n, then the bonus g_{n+1} at index n: [batch, max_spec_len + 1]
    targets = torch.cat([targets, torch.full_like(targets[:, :1], PLACEHOLDER_TOKEN_ID)], dim=1)
    bonus = bonus_token_ids.reshape(-1, 1).long()  # [batch, 1]
    targets = targets.scatter(1, num_draft_tokens[:, None], bonus)  # [batch, max_spec_len + 1]
    return rules.lossless_greedy(drafts, num_draft_tokens, targets)


def lossless_greedy_ragged(
    # [num_tokens] integer: y_i, all requests back to back
    draft_token_ids: torch.Tensor,
    # [num_tokens] integer: g_i, the verifier's argmax at each draft position
    target_token_ids: torch.Tensor,
    # [batch] or [batch, 1] integer: g_{n+1}, the verifier's argmax after the block
    bonus_token_ids: torch.Tensor,
    # [batch] integer: inclusive cumulative draft counts
    cu_num_draft_tokens: torch.Tensor,
    max_spec_len: int,
    backend: Backend | str = Backend.AUTO,
) -> Verdict:  # output_token_ids [batch, max_spec_len + 1]
    """Greedy verification (ProVe-lossless, docs/METHODS.md §4; strict SDD, §7). Lossless.

    With ``j`` the first ``i <= n`` where ``y_i != g_i``: commit ``y_1..y_{j-1}`` (accepted)
    and ``g_j`` (recovered); if all ``n`` match, ``y_1..y_n`` and ``g_{n+1}`` (bonus). The
    same output as vLLM's ``rejection_greedy_sample_kernel``. Rows hold 0..max_spec_len drafts.
    """
    args = (draft_token_ids, target_token_ids, bonus_token_ids, cu_num_draft_tokens, max_spec_len)
    if _use_triton(backend, target_token_ids):
        return _kernels("block_gates").lossless_greedy(*args)
    return lossless_greedy_ragged_torch(*args)


def feasible_prefix_ragged_torch(
    # [num_tokens] float: q_j
    scores: torch.Tensor,
    # [batch] integer
    cu_num_draft_tokens: torch.Tensor,
    eta_b: float,
    eta_c: float,
    prefix_gate: PrefixGate | str,
    max_spec_len: int,
) -> torch.Tensor:  # [batch] int64
    """Twin of ``triton_ops.feasible_prefix.feasible_prefix_kernel``: ``skip_policy``'s."""
    padded, num_draft_tokens = ragged_to_padded(scores, cu_num_draft_tokens, max_spec_len, PAD_PROB)
    return skip_policy.feasible_prefix(padded, num_draft_tokens, eta_b, eta_c, prefix_gate)


def feasible_prefix_ragged(
    # [num_tokens] float: q_j, all requests back to back
    scores: torch.Tensor,
    # [batch] integer: inclusive cumulative draft counts
    cu_num_draft_tokens: torch.Tensor,
    eta_b: float,
    eta_c: float,
    prefix_gate: PrefixGate | str,
    max_spec_len: int,
    backend: Backend | str = Backend.AUTO,
) -> torch.Tensor:  # [batch] int64: K^
    """``K^ = max{k <= n : B_k >= eta_b and C_k >= eta_c}``, 0 if none (docs/METHODS.md §7).

    ``B_k = min_{j<=k} q_j``; ``C_k`` is the minimum, the product (in log space) or the
    geometric mean of ``q_1..q_k`` per ``prefix_gate``; float64 arithmetic. Rows hold
    0..max_spec_len scores.
    """
    _check_unit_interval("eta_b", eta_b)
    _check_unit_interval("eta_c", eta_c)
    args = (scores, cu_num_draft_tokens, eta_b, eta_c, PrefixGate(prefix_gate), max_spec_len)
    if _use_triton(backend, scores):
        return _kernels("feasible_prefix").feasible_prefix(*args)
    return feasible_prefix_ragged_torch(*args)
