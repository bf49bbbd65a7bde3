"""Acceptance rules: pure, batched functions from a draft block to a ``Verdict``.

Every rule works on padded ``[batch, block]`` tensors with a per-row length
``num_draft_tokens`` and never loops over rows. A rule first marks the positions that pass
its test, then takes the longest passing prefix with the EAGLE/Medusa trick
``cumprod(passed).sum(-1)`` (``accepted_prefix_length``).

Rules (docs/METHODS.md):
- ProVe gates, lossy, never emit a verifier token (§3, §5): ``product_gate``,
  ``verifier_only_gate``, ``proposer_only_gate`` (the MARS confidence rule).
- Greedy verification, lossless, append a recovered or bonus token (§4, §7):
  ``lossless_greedy`` over target token ids, ``strict_greedy`` over target logits.
- SDD relaxations, lossy, append the target argmax (§7): ``lenient_accept``, ``topk_accept``.

The Triton kernels in ``triton_ops`` are tested for equality against these functions.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable

import torch

from vllm_prove.core.contracts import BlockProposal, Verdict

# ProVe commits y_1 whatever the scores say (it is the ordinary AR token, docs/METHODS.md §1, §3).
ALWAYS_COMMITTED = 1


def _check_unit_interval(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:  # also rejects NaN
        raise ValueError(f"{name} must lie in [0, 1], got {value}")


def accepted_prefix_length(
    # [batch, block] bool: position passes the rule's test
    passed: torch.Tensor,
    # [batch] int64: valid draft length per row
    num_draft_tokens: torch.Tensor,
    min_accept: int = 0,
) -> torch.Tensor:  # [batch] int64
    """Longest prefix of ``passed`` inside the first ``num_draft_tokens`` positions.

    The first ``min_accept`` positions count as passed whatever ``passed`` says, so the
    result lies in ``[min(min_accept, num_draft_tokens), num_draft_tokens]``.
    """
    if min_accept < 0:
        raise ValueError(f"min_accept must be >= 0, got {min_accept}")
    block = passed.shape[-1]
    positions = torch.arange(block, device=passed.device)  # [block]
    forced = positions < min_accept  # [block]
    in_range = positions[None, :] < num_draft_tokens[:, None]  # [batch, block]
    ok = (passed | forced[None, :]) & in_range  # [batch, block]
    return torch.cumprod(ok.to(torch.int64), dim=-1).sum(dim=-1)


def product_gate(
    proposal: BlockProposal,
    # [batch, block] float32: q_i = P_V(y_i | x, y_<i), teacher-forced verifier probability
    verifier_probs: torch.Tensor,
    theta: float,
) -> Verdict:
    """ProVe's default gate (docs/METHODS.md §3; ProVe §3.2). Lossy.

    ``s_i = p~_i * q_i``; commit ``y_1..y_a`` with
    ``a = max{a : s_i >= theta for every 2 <= i <= a}``. ``y_1`` is always committed and
    nothing the verifier predicts is emitted, so ``num_emitted == num_accepted``.
    """
    _check_unit_interval("theta", theta)
    scores = proposal.proposer_probs * verifier_probs  # [batch, block]
    return _gate_verdict(proposal, scores >= theta)


def verifier_only_gate(
    proposal: BlockProposal,
    # [batch, block] float32: q_i
    verifier_probs: torch.Tensor,
    theta: float,
) -> Verdict:
    """Verifier-only gate (docs/METHODS.md §3; ProVe appendix C). Lossy.

    Commit ``y_1..y_a`` with ``a = max{a : q_i >= theta for every 2 <= i <= a}``;
    ``y_1`` always committed; no verifier token emitted.
    """
    _check_unit_interval("theta", theta)
    return _gate_verdict(proposal, verifier_probs >= theta)


def proposer_only_gate(proposal: BlockProposal, tau: float) -> Verdict:
    """MARS confidence rule / proposer-only gate (docs/METHODS.md §5; ProVe appendix C). Lossy.

    Commit ``y_1``, then continue while ``p~_i >= tau``:
    ``a = max{a : p~_i >= tau for every 2 <= i <= a}``. No verifier pass at all.
    """
    _check_unit_interval("tau", tau)
    return _gate_verdict(proposal, proposal.proposer_probs >= tau)


def _gate_verdict(
    proposal: BlockProposal,
    # [batch, block] bool
    passed: torch.Tensor,
) -> Verdict:
    num_accepted = accepted_prefix_length(
        passed, proposal.num_draft_tokens, min_accept=ALWAYS_COMMITTED
    )  # [batch]
    return Verdict.from_prefix(proposal.draft_token_ids, num_accepted)


def lossless_greedy(
    # [batch, block] int64: y_1..y_B
    draft_token_ids: torch.Tensor,
    # [batch] int64: valid draft length n per row
    num_draft_tokens: torch.Tensor,
    # [batch, block + 1] int64: the verifier's greedy predictions g_1..g_{B+1}
    target_token_ids: torch.Tensor,
) -> Verdict:
    """Greedy verification: ProVe-lossless (docs/METHODS.md §4) and Strict SDD (§7). Lossless.

    Let ``j`` be the first ``i <= n`` with ``y_i != g_i``: commit ``y_1..y_{j-1}`` (accepted)
    and ``g_j`` (recovered). If ``y_1..y_n`` all match: commit them and ``g_{n+1}`` (bonus).
    The emitted row is therefore ``g_1..g_{a+1}``: greedy AR decoding token for token.
    """
    block = draft_token_ids.shape[1]
    matches = draft_token_ids == target_token_ids[:, :block]  # [batch, block]
    num_accepted = accepted_prefix_length(matches, num_draft_tokens)  # [batch]
    return _verdict_with_target_token(draft_token_ids, num_accepted, target_token_ids)


def strict_greedy(
    # [batch, block] int64
    draft_token_ids: torch.Tensor,
    # [batch] int64
    num_draft_tokens: torch.Tensor,
    # [batch, block + 1, vocab] float: target logits at the block positions plus the bonus one
    target_logits: torch.Tensor,
) -> Verdict:
    """Strict SDD (docs/METHODS.md §7): ``lossless_greedy`` against ``argmax_v z_j(v)``. Lossless.

    Accept ``x_j`` while ``x_j == argmax_v z_j(v)``; target argmax at the first mismatch,
    bonus argmax if all ``n`` match.
    """
    target_token_ids = target_logits.argmax(dim=-1)  # [batch, block + 1]
    return lossless_greedy(draft_token_ids, num_draft_tokens, target_token_ids)


def lenient_accept(
    # [batch, block] int64
    draft_token_ids: torch.Tensor,
    # [batch] int64
    num_draft_tokens: torch.Tensor,
    # [batch, block + 1, vocab] float
    target_logits: torch.Tensor,
    lenience: float,
) -> Verdict:
    """Lenience (docs/METHODS.md §7; SDD-skipping paper appendix A.6, eq. 9). Lossy for l < 1.

    Accept ``x_j`` while ``z_j(x_j) - max_v z_j(v) >= log l``, ``0 < l <= 1``; target argmax
    at the first rejection; bonus argmax if all pass. At ``l = 1`` the paper uses the strict
    argmax comparison so ties break identically, and so does this function.
    """
    if not 0.0 < lenience <= 1.0:
        raise ValueError(f"lenience must lie in (0, 1], got {lenience}")
    if lenience == 1.0:
        return strict_greedy(draft_token_ids, num_draft_tokens, target_logits)
    block = draft_token_ids.shape[1]
    logits = target_logits[:, :block].float()  # [batch, block, vocab]
    draft_logit = _logit_of(logits, draft_token_ids)  # [batch, block]
    gap = draft_logit - logits.amax(dim=-1)  # [batch, block]
    passed = gap >= math.log(lenience)  # [batch, block]
    return _argmax_fallback_verdict(draft_token_ids, num_draft_tokens, target_logits, passed)


def topk_accept(
    # [batch, block] int64
    draft_token_ids: torch.Tensor,
    # [batch] int64
    num_draft_tokens: torch.Tensor,
    # [batch, block + 1, vocab] float
    target_logits: torch.Tensor,
    k: int,
) -> Verdict:
    """Top-k acceptance (docs/METHODS.md §7; SDD-skipping paper appendix A.6). Lossy for k > 1.

    Accept ``x_j`` while ``z_j(x_j) >= v_k``, the k-th largest target logit at position ``j``
    (ties with the k-th value count as inside); target argmax at the first rejection; bonus
    argmax if all pass.
    """
    vocab = target_logits.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"k must lie in [1, vocab={vocab}], got {k}")
    block = draft_token_ids.shape[1]
    logits = target_logits[:, :block]  # [batch, block, vocab]
    kth_largest = logits.topk(k, dim=-1).values[..., -1]  # [batch, block]
    draft_logit = _logit_of(logits, draft_token_ids)  # [batch, block]
    passed = draft_logit >= kth_largest  # [batch, block]
    return _argmax_fallback_verdict(draft_token_ids, num_draft_tokens, target_logits, passed)


def _logit_of(
    # [batch, block, vocab] float
    logits: torch.Tensor,
    # [batch, block] int64
    draft_token_ids: torch.Tensor,
) -> torch.Tensor:  # [batch, block]: z_j(x_j)
    # Padding ids (PLACEHOLDER_TOKEN_ID) are clamped to a valid index; their positions lie
    # past num_draft_tokens and no rule reads them.
    index = draft_token_ids.clamp(min=0)[..., None]  # [batch, block, 1]
    return logits.gather(-1, index)[..., 0]


def _argmax_fallback_verdict(
    # [batch, block] int64
    draft_token_ids: torch.Tensor,
    # [batch] int64
    num_draft_tokens: torch.Tensor,
    # [batch, block + 1, vocab] float
    target_logits: torch.Tensor,
    # [batch, block] bool
    passed: torch.Tensor,
) -> Verdict:
    num_accepted = accepted_prefix_length(passed, num_draft_tokens)  # [batch]
    target_token_ids = target_logits.argmax(dim=-1)  # [batch, block + 1]
    return _verdict_with_target_token(draft_token_ids, num_accepted, target_token_ids)


def _verdict_with_target_token(
    # [batch, block] int64
    draft_token_ids: torch.Tensor,
    # [batch] int64
    num_accepted: torch.Tensor,
    # [batch, block + 1] int64
    target_token_ids: torch.Tensor,
) -> Verdict:
    # Index a (0-based) holds g_{a+1}: the recovered token at the first rejection, or the
    # bonus token when all n draft tokens were accepted (a = n).
    extra = target_token_ids.gather(1, num_accepted[:, None])[:, 0]  # [batch]
    return Verdict.from_prefix(draft_token_ids, num_accepted, extra)


class GateKind(str, enum.Enum):
    """The ProVe gates compared in the paper (appendix C); ``product`` is the default."""

    PRODUCT = "product"
    VERIFIER = "verifier"
    PROPOSER = "proposer"

    @property
    def needs_verifier(self) -> bool:
        """Whether the gate reads verifier probabilities (and so needs a verify pass)."""
        return self is not GateKind.PROPOSER


GateFn = Callable[[BlockProposal, torch.Tensor | None, float], Verdict]


def _proposer_gate_entry(
    proposal: BlockProposal,
    # [batch, block] float32 or None: ignored
    verifier_probs: torch.Tensor | None,
    threshold: float,
) -> Verdict:
    return proposer_only_gate(proposal, threshold)


# Registry from enum to rule, all with the signature (proposal, verifier_probs, threshold).
GATES: dict[GateKind, GateFn] = {
    GateKind.PRODUCT: product_gate,
    GateKind.VERIFIER: verifier_only_gate,
    GateKind.PROPOSER: _proposer_gate_entry,
}


def apply_gate(
    kind: GateKind | str,
    proposal: BlockProposal,
    # [batch, block] float32 or None: q_i; may be None only for the proposer gate
    verifier_probs: torch.Tensor | None,
    threshold: float,
) -> Verdict:
    """Apply the gate ``kind`` with its threshold (theta for verifier gates, tau otherwise)."""
    kind = GateKind(kind)
    if kind.needs_verifier and verifier_probs is None:
        raise ValueError(f"gate {kind.value!r} needs verifier_probs, got None")
    return GATES[kind](proposal, verifier_probs, threshold)
