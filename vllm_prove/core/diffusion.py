"""Masked-diffusion drafting, engine-free (docs/METHODS.md §7): reveal schedule, reveal choice,
and the per-token features the survival predictors read.

A block of `gamma` masks is denoised in `T` steps. At each step the drafter scores every
still-masked position; the most confident ones are revealed (their argmax token is fixed)::

    step 0:  [ m  m  m  m  m  m  m  m ]   reveal the 4 most confident
    step 1:  [ x1 m  x3 x4 m  m  x7 m ]   reveal the remaining 4
    done:    [ x1 x2 x3 x4 x5 x6 x7 x8 ]

A token's *raw confidence* is the probability of its token in the pass that revealed it; its
*reveal step* is that pass's index. Everything here is a pure function of the drafter's
probabilities or of a `pass_fn` that runs the drafter: `denoise` is the one reveal loop of the
transformers drafter (`vllm_prove.reference.drafter`) and of the vLLM one (`vllm_prove.engine.diffusion`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_prove.core.contracts import PLACEHOLDER_TOKEN_ID

# Reveal order ties (equal confidence) break towards the earlier position (a stable sort).
TOP_MASS_K = 5  # "top-5 mass" feature
NUM_SCALAR_FEATURES = 19
SCALAR_FEATURES = (
    "reveal_step",  # 0-based index of the pass that revealed the token
    "reveal_rank",  # order of reveal inside the block, normalized to [0, 1]
    "reveal_parallelism",  # tokens revealed in the same pass / gamma
    "late_reveal",  # 1 if revealed in the last pass
    "top1_prob",  # raw confidence
    "log_top1_prob",
    "entropy",
    "neg_entropy",
    "margin",  # top-1 minus top-2 probability
    "top5_mass",
    "top1_prob_step0",  # the same position's top-1 probability in the first pass
    "neg_entropy_step0",
    "delta_top1_prob",  # reveal pass minus first pass
    "delta_neg_entropy",
    "block_position",  # j / gamma
    "generated_length",  # log1p(tokens generated so far in the request)
    "segment_position",  # tokens generated so far / max_new_tokens
    "is_code",  # dataset indicators (the paper's code vs math suites)
    "is_math",
)
assert len(SCALAR_FEATURES) == NUM_SCALAR_FEATURES


def _per_row(value: int | torch.Tensor, batch: int, gamma: int) -> torch.Tensor:  # [batch, gamma] float32
    """A per-request limit (an int or [batch]) broadcast over the block, at least 1."""
    return torch.as_tensor(value, dtype=torch.float32).clamp(min=1).reshape(-1, 1).expand(batch, gamma)


def reveal_counts(gamma: int, steps: int) -> list[int]:
    """Tokens revealed at each of the `steps` passes: `gamma` split as evenly as possible,
    earlier passes taking the remainder (gamma 32, T 2 -> [16, 16]; gamma 5, T 2 -> [3, 2])."""
    if not 1 <= steps <= gamma:
        raise ValueError(f"steps must lie in [1, gamma={gamma}], got {steps}")
    base, extra = divmod(gamma, steps)
    return [base + (1 if s < extra else 0) for s in range(steps)]


def select_reveals(
    # [batch, gamma] float: confidence of each position's argmax in this pass
    confidence: torch.Tensor,
    # [batch, gamma] bool: still masked
    masked: torch.Tensor,
    count: int,
) -> torch.Tensor:  # [batch, gamma] bool: positions revealed by this pass
    """The `count` most confident masked positions of each row (all of them if fewer remain);
    equal confidences go to the earlier position."""
    gamma = confidence.shape[-1]
    score = torch.where(masked, confidence.double(), -math.inf)  # [batch, gamma]
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices  # [batch, gamma]
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(gamma).expand_as(order))  # [batch, gamma]
    return masked & (rank < count)


def distribution_stats(
    # [batch, gamma, vocab] float
    probs: torch.Tensor,
) -> dict[str, torch.Tensor]:  # each [batch, gamma]
    """Top-1 probability and token, entropy, top-1 minus top-2 margin, top-5 mass."""
    top = probs.topk(min(TOP_MASS_K, probs.shape[-1]), dim=-1)
    entropy = -(probs * probs.clamp(min=1e-30).log()).sum(-1)
    second = top.values[..., 1] if top.values.shape[-1] > 1 else torch.zeros_like(top.values[..., 0])
    return {"token": top.indices[..., 0], "top1_prob": top.values[..., 0], "entropy": entropy,
            "margin": top.values[..., 0] - second, "top5_mass": top.values.sum(-1)}


def scalar_features(
    # [batch, gamma] each: stats of the reveal pass (see DraftState.record)
    reveal: dict[str, torch.Tensor],
    # [batch, gamma] each: stats of the first pass
    first: dict[str, torch.Tensor],
    # [batch, gamma] int64
    reveal_step: torch.Tensor,
    # [batch, gamma] int64: order of reveal in the block (0 = first revealed)
    reveal_rank: torch.Tensor,
    # [batch] int64: tokens the request had generated before this block
    generated: torch.Tensor,
    # an int for every row, or [batch] int64: each request's max_tokens
    max_new_tokens: int | torch.Tensor,
    steps: int,
    dataset: str = "code",
) -> torch.Tensor:  # [batch, gamma, NUM_SCALAR_FEATURES] float32
    """The 19 scalars of docs/METHODS.md §7, in `SCALAR_FEATURES` order."""
    batch, gamma = reveal_step.shape
    counts = torch.zeros(batch, steps, dtype=torch.float32).scatter_add_(
        1, reveal_step, torch.ones(batch, gamma))  # [batch, steps]
    top1 = reveal["top1_prob"].float()
    neg_h, neg_h0 = -reveal["entropy"].float(), -first["entropy"].float()
    gen = generated.float()[:, None].expand(batch, gamma)
    cols = [
        reveal_step.float(),
        reveal_rank.float() / max(1, gamma - 1),
        counts.gather(1, reveal_step) / gamma,
        (reveal_step == steps - 1).float(),
        top1,
        top1.clamp(min=1e-30).log(),
        -neg_h,
        neg_h,
        reveal["margin"].float(),
        reveal["top5_mass"].float(),
        first["top1_prob"].float(),
        neg_h0,
        top1 - first["top1_prob"].float(),
        neg_h - neg_h0,
        torch.arange(gamma, dtype=torch.float32)[None].expand(batch, gamma) / gamma,
        gen.log1p(),
        gen / _per_row(max_new_tokens, batch, gamma),
        torch.full((batch, gamma), float(dataset == "code")),
        torch.full((batch, gamma), float(dataset == "math")),
    ]
    return torch.stack(cols, dim=-1)


@dataclass(frozen=True)
class DraftBlock:
    """One drafted block per row (rows not drafting hold PLACEHOLDER_TOKEN_ID, n = 0)."""

    draft_token_ids: torch.Tensor  # [batch, gamma] int64
    num_draft_tokens: torch.Tensor  # [batch] int64
    confidence: torch.Tensor  # [batch, gamma] float: probability of the token at its reveal pass
    reveal_step: torch.Tensor  # [batch, gamma] int64
    hidden: torch.Tensor | None = None  # [batch, gamma, hidden]: LM-head input at the reveal pass
    scalars: torch.Tensor | None = None  # [batch, gamma, NUM_SCALAR_FEATURES]


# pass_fn(tokens [batch, gamma] int64, step) -> (logits [batch, gamma, vocab], LM-head inputs
# [batch, gamma, hidden]); index j predicts block token j; ids that must never be drafted
# (the mask) already at -inf.
DenoisePass = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


@torch.no_grad()
def denoise(
    pass_fn: DenoisePass,
    # [batch] bool: rows that draft
    active: torch.Tensor,
    gamma: int,
    steps: int,
    mask_token_id: int,
    *,
    features: bool = False,
    # [batch] int64: tokens each row generated before this block (a survival feature)
    generated: torch.Tensor | None = None,
    # an int, or [batch]: each request's max_tokens (a survival feature)
    max_new_tokens: int | torch.Tensor = 1,
    dataset: str = "code",
) -> DraftBlock:
    """Denoise `gamma` masks in `steps` passes, revealing the most confident masks each pass
    (`reveal_counts`, `select_reveals`); with `features`, the survival predictors' inputs."""
    batch = active.shape[0]
    device = active.device
    act = active[:, None]  # [batch, 1]
    tokens = torch.full((batch, gamma), mask_token_id, dtype=torch.long, device=device)
    masked = act.expand(batch, gamma).clone()  # [batch, gamma]
    confidence = torch.zeros(batch, gamma, device=device)
    step_of = torch.zeros(batch, gamma, dtype=torch.long, device=device)
    rank = torch.zeros(batch, gamma, dtype=torch.long, device=device)
    hidden = stats_at = first = None
    for s, count in enumerate(reveal_counts(gamma, steps)):
        logits, h = pass_fn(tokens, s)  # [batch, gamma, vocab], [batch, gamma, hidden]
        probs = torch.softmax(logits.float(), dim=-1)  # [batch, gamma, vocab]
        if features:
            stats = distribution_stats(probs)  # each [batch, gamma]
        else:  # what the reveal needs: the argmax and its probability
            top = probs.max(dim=-1)
            stats = {"token": top.indices, "top1_prob": top.values}
        if s == 0:
            first = stats
            stats_at = {k: v.clone() for k, v in stats.items()}
            hidden = torch.zeros(batch, gamma, h.shape[-1], device=device) if features else None
        reveal = select_reveals(stats["top1_prob"], masked, count)  # [batch, gamma]
        tokens = torch.where(reveal, stats["token"], tokens)
        confidence = torch.where(reveal, stats["top1_prob"], confidence)
        step_of = torch.where(reveal, s, step_of)
        order = torch.cumsum(reveal.long(), 1) - 1 + (~masked & act).sum(1, keepdim=True)  # rank within reveals
        rank = torch.where(reveal, order, rank)
        for k in stats_at:
            stats_at[k] = torch.where(reveal, stats[k], stats_at[k])
        if hidden is not None:
            hidden = torch.where(reveal[..., None], h.float(), hidden)
        masked &= ~reveal
    n = torch.where(active, gamma, 0)  # [batch]
    tokens = torch.where(act, tokens, PLACEHOLDER_TOKEN_ID)
    scalars = None
    if features:
        if generated is None:
            generated = torch.zeros(batch, dtype=torch.long, device=device)
        scalars = scalar_features(stats_at, first, step_of, rank, generated, max_new_tokens, steps, dataset)
    return DraftBlock(tokens, n, confidence, step_of, hidden, scalars)
