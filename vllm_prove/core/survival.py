"""Survival labels, prompt folds and the permutation diagnostic (docs/METHODS.md §7).

Engine-free pieces of the survival predictors of the SDD-skipping paper. They read a strict-SDD
trace: one row per round b (the batch dimension), one column per draft position j = 1..gamma
(the block dimension), with ``L_b`` the strict-SDD accepted draft length and ``n_b`` the valid
draft length (``num_draft_tokens``, ``0 <= L_b <= n_b <= gamma``).

- ``survival_labels``: the training targets of the two predictors. Marginal: ``1{L >= j}`` on
  every valid position. Conditional: positive for ``j <= L``, negative at ``j = L + 1`` when
  ``L < n``, later positions masked out (the event "token j survives given j - 1 survived").
- ``fold_assignment`` / ``rotation``: five folds by prompt id (shuffle seed 12345); rotation r
  tests fold r and validates on fold r + 1 mod 5.
- ``permutation_diagnostic``: how much of the feasible prefix ``K^`` rests on the dependence
  between positions of one block.
"""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass
from typing import NamedTuple

import torch

from vllm_prove.core.metrics import full_prefix_acceptance, strict_token_agreement
from vllm_prove.core.skip_policy import PrefixGate, feasible_prefix

DEFAULT_NUM_FOLDS = 5  # paper: five folds by prompt id
FOLD_SEED = 12345  # paper's shuffle seed for the prompt ids
DEFAULT_REPEATS = 100  # paper: 100 permutation repeats
PERMUTATION_SEED = 0  # project choice: any fixed seed; the diagnostic reports means


class SurvivalSignal(str, enum.Enum):
    """The two learned survival signals (paper §4.2), each with its own predictor."""

    MARGINAL = "marginal"  # a^_j ~ P(L >= j); prefix gate min_j a^_j
    CONDITIONAL = "conditional"  # s^_j ~ P(L >= j | L >= j - 1); prefix gate prod_j s^_j

    @property
    def prefix_gate(self) -> PrefixGate:
        """The ``C_k`` that goes with this signal in ``feasible_prefix``."""
        return PrefixGate.MIN if self is SurvivalSignal.MARGINAL else PrefixGate.PRODUCT


def _check_lengths(
    # [batch] int64: L
    accepted: torch.Tensor,
    # [batch] int64: n
    num_draft_tokens: torch.Tensor,
    block: int,
) -> None:
    if accepted.shape != num_draft_tokens.shape or accepted.dim() != 1:
        raise ValueError(
            "accepted and num_draft_tokens must be 1-D of one length, got "
            f"{tuple(accepted.shape)} and {tuple(num_draft_tokens.shape)}"
        )
    if bool((num_draft_tokens < 0).any() or (num_draft_tokens > block).any()):
        raise ValueError(f"num_draft_tokens must lie in [0, {block}]")
    if bool((accepted < 0).any() or (accepted > num_draft_tokens).any()):
        raise ValueError("accepted (L) must lie in [0, num_draft_tokens] on every row")


def survival_labels(
    # [batch] int64: L, strict-SDD accepted draft length
    accepted: torch.Tensor,
    # [batch] int64: n, valid draft length
    num_draft_tokens: torch.Tensor,
    block: int,
    signal: SurvivalSignal | str,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([batch, block] float32 labels, [batch, block] bool mask)
    """Labels and mask of one signal for positions j = 1..block (column j - 1).

    - marginal: ``label_j = 1{L >= j}``, mask ``j <= n`` (every valid position of every block).
    - conditional: ``label_j = 1{j <= L}``, mask ``j <= min(L + 1, n)``: positives up to L, one
      negative at ``j = L + 1`` when ``L < n``, nothing after (survival there is undefined).

    Masked-out positions carry label 0.
    """
    signal = SurvivalSignal(signal)
    _check_lengths(accepted, num_draft_tokens, block)
    j = torch.arange(1, block + 1, device=accepted.device)[None, :]  # [1, block]
    labels = (j <= accepted[:, None]).to(torch.float32)  # [batch, block]
    last = num_draft_tokens  # [batch]
    if signal is SurvivalSignal.CONDITIONAL:
        last = torch.minimum(accepted + 1, num_draft_tokens)
    mask = j <= last[:, None]  # [batch, block]
    return labels * mask, mask


def fold_assignment(
    # [batch] int64: prompt id of each row
    prompt_ids: torch.Tensor,
    num_folds: int = DEFAULT_NUM_FOLDS,
    seed: int = FOLD_SEED,
) -> torch.Tensor:  # [batch] int64: fold of each row, in [0, num_folds)
    """Folds by prompt id, so that every row of one prompt lands in one fold.

    The distinct prompt ids, sorted ascending, are shuffled with ``random.Random(seed).shuffle``
    (Python's generator: its sequence is fixed across platforms and torch versions) and cut
    into ``num_folds`` contiguous parts whose sizes differ by at most one, the larger first.
    """
    distinct = torch.unique(prompt_ids).tolist()  # sorted ascending
    if num_folds < 2 or len(distinct) < num_folds:
        raise ValueError(
            f"need num_folds >= 2 and at least num_folds distinct prompt ids, got "
            f"num_folds={num_folds} with {len(distinct)} distinct prompt ids"
        )
    random.Random(seed).shuffle(distinct)
    base, extra = divmod(len(distinct), num_folds)
    fold_of: dict[int, int] = {}
    start = 0
    for fold in range(num_folds):
        size = base + (1 if fold < extra else 0)
        fold_of.update((pid, fold) for pid in distinct[start : start + size])
        start += size
    return torch.tensor([fold_of[pid] for pid in prompt_ids.tolist()], dtype=torch.int64)


class FoldRotation(NamedTuple):
    """One cross-validation rotation: train on ``train``, early-stop on ``validation``."""

    train: tuple[int, ...]
    validation: int
    test: int


def rotation(r: int, num_folds: int = DEFAULT_NUM_FOLDS) -> FoldRotation:
    """Rotation r: test fold r, validation fold ``(r + 1) mod num_folds``, train on the rest."""
    if not 0 <= r < num_folds:
        raise ValueError(f"rotation r must lie in [0, {num_folds}), got {r}")
    validation = (r + 1) % num_folds
    train = tuple(f for f in range(num_folds) if f not in (r, validation))
    return FoldRotation(train=train, validation=validation, test=r)


@dataclass(frozen=True)
class PermutationDiagnostic:
    """Feasible prefix and agreement with strict SDD, realized vs. permuted blocks."""

    mean_prefix_realized: float  # mean K^ over all rounds
    mean_prefix_permuted: float  # mean K^ over all rounds and repeats
    strict_token_realized: float  # sum min(K, L) / sum K over rounds with K > 0 (NaN if none)
    strict_token_permuted: float  # the same, pooled over every repeat
    full_prefix_realized: float  # mean 1{K <= L} over rounds with K > 0 (NaN if none)
    full_prefix_permuted: float  # the same, pooled over every repeat
    repeats: int


def _agreement(
    # [num_rows] int64: K^
    K_hat: torch.Tensor,
    # [num_rows] int64: L
    accepted: torch.Tensor,
) -> tuple[float, float]:  # (StrictToken, FullPrefix); NaN when no row has K^ > 0
    # core.metrics raises on an empty set (no relaxed round); a diagnostic reports NaN instead.
    if not bool((K_hat > 0).any()):
        return math.nan, math.nan
    return strict_token_agreement(K_hat, accepted), full_prefix_acceptance(K_hat, accepted)


def permutation_diagnostic(
    # [batch, block] float: recorded per-position score q_j of each round
    scores: torch.Tensor,
    # [batch] int64: L, strict-SDD accepted draft length of each round
    accepted: torch.Tensor,
    # [batch] int64: n, valid draft length of each round
    num_draft_tokens: torch.Tensor,
    eta_b: float,
    eta_c: float,
    gate: PrefixGate | str,
    repeats: int = DEFAULT_REPEATS,
    seed: int = PERMUTATION_SEED,
) -> PermutationDiagnostic:
    """Feasible prefix before and after breaking the within-block dependence (paper §5).

    What is permuted: each round b contributes, at each position j, the triple
    ``(q_bj, 1{L_b >= j}, 1{j <= n_b})`` (score, marginal acceptance label, validity). For
    every position j independently, the triples of column j are shuffled across rounds with
    their own random permutation ``pi_j``; a synthetic round b' is then the sequence of
    triples ``(q_{pi_j(b'), j})_j``. Each position keeps its marginal distribution of (score,
    label) pairs and each score keeps its own label, but which scores and labels share a
    block is random. For a synthetic round, ``n'`` is the length of its leading valid run and
    ``L'`` the length of its leading run of positive labels; ``K^`` is recomputed from its
    scores with ``feasible_prefix(.., eta_b, eta_c, gate)``.

    Reports the mean ``K^`` over rounds (realized; permuted: also averaged over ``repeats``)
    and StrictToken / FullPrefix against ``L`` (``L'`` for the permuted rounds, pooled over all
    repeats). Seeded with ``torch.Generator().manual_seed(seed)``; deterministic on the CPU.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    batch, block = scores.shape
    _check_lengths(accepted, num_draft_tokens, block)
    scores, accepted, n = scores.cpu(), accepted.cpu(), num_draft_tokens.cpu()
    labels, valid = survival_labels(accepted, n, block, SurvivalSignal.MARGINAL)  # [batch, block]
    K_real = feasible_prefix(scores, n, eta_b, eta_c, gate)  # [batch]
    generator = torch.Generator().manual_seed(seed)
    K_perm, L_perm = [], []
    for _ in range(repeats):
        # argsort of iid uniforms per column: an independent uniform permutation per position
        order = torch.rand(batch, block, generator=generator).argsort(dim=0)  # [batch, block]
        valid_p = valid.gather(0, order)  # [batch, block]
        n_p = torch.cumprod(valid_p.to(torch.int64), dim=-1).sum(dim=-1)  # [batch]
        labels_p = labels.gather(0, order) > 0  # [batch, block]
        L_perm.append(torch.cumprod(labels_p.to(torch.int64), dim=-1).sum(dim=-1))  # [batch]
        K_perm.append(feasible_prefix(scores.gather(0, order), n_p, eta_b, eta_c, gate))
    K_perm_all = torch.cat(K_perm)  # [repeats * batch]
    strict_real, full_real = _agreement(K_real, accepted)
    strict_perm, full_perm = _agreement(K_perm_all, torch.cat(L_perm))
    return PermutationDiagnostic(
        mean_prefix_realized=float(K_real.double().mean()),
        mean_prefix_permuted=float(K_perm_all.double().mean()),
        strict_token_realized=strict_real,
        strict_token_permuted=strict_perm,
        full_prefix_realized=full_real,
        full_prefix_permuted=full_perm,
        repeats=repeats,
    )
