"""Verifier skipping for speculative diffusion decoding (docs/METHODS.md §7; SDD-skipping paper §4.1).

A lossy policy that, in some rounds, commits a prefix of the diffusion draft without calling
the target. Per round and row:

1. ``feasible_prefix``: ``K^ = max{k : B_k >= eta_b and C_k >= eta_c}`` (0 if none).
2. ``guard_flags``: the safety guards (special/EOS token, repetition, invalid scores,
   shortened final block).
3. ``SkipPolicy.decide``: force a strict round when ``D >= S_max``; otherwise skip iff
   ``K^ > 0``, ``K^ >= K_min`` and the guards pass. A skip commits ``x_1..x_K^`` and sets
   ``D += K^``; a strict round calls the verifier, which resets ``D = 0``.

``D`` (unverified tokens committed since the last verifier call) is the policy's only state;
the caller keeps it per request and threads it through ``decide``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

# K^ when no prefix satisfies both gates (paper eq. 3: max of the empty set is 0).
NO_FEASIBLE_PREFIX = 0
# Defaults for the repetition guard (project choice, see guard_flags).
DEFAULT_REPETITION_NGRAM = 4
DEFAULT_REPETITION_MIN_REPEATS = 4


class PrefixGate(str, enum.Enum):
    """How ``C_k`` summarizes the scores ``q_1..q_k`` (paper §4.2, one per signal)."""

    GEOMETRIC_MEAN = "geometric_mean"  # raw confidence: (prod_j q_j)^(1/k)
    MIN = "min"  # marginal survival: min_j a^_j
    PRODUCT = "product"  # conditional survival: prod_j s^_j, in log space


def _prefix_gate_scores(
    # [batch, block] float
    scores: torch.Tensor,
    gate: PrefixGate,
) -> torch.Tensor:  # [batch, block]: C_k at index k-1 (log C_k unless gate is MIN)
    if gate is PrefixGate.MIN:
        return torch.cummin(scores, dim=-1).values
    log_scores = torch.log(scores)  # [batch, block]; log 0 = -inf; log(<0) = NaN, which fails
    cum_log = torch.cumsum(log_scores, dim=-1)  # [batch, block]
    if gate is PrefixGate.PRODUCT:
        return cum_log
    lengths = torch.arange(1, scores.shape[-1] + 1, device=scores.device)  # [block]
    # log of the geometric mean; comparing exp(.) instead would reject exact ties (exp(log x) < x)
    return cum_log / lengths


def prefix_threshold(gate: PrefixGate, eta_c: float) -> float:
    """What ``C_k`` is compared with: ``eta_c`` for MIN, ``log eta_c`` for the log-space gates."""
    if gate is PrefixGate.MIN:
        return eta_c
    return math.log(eta_c) if eta_c > 0 else -math.inf


def feasible_prefix(
    # [batch, block] float: per-position score q_j in [0, 1]
    scores: torch.Tensor,
    # [batch] int64: valid draft length per row
    num_draft_tokens: torch.Tensor,
    eta_b: float,
    eta_c: float,
    prefix_gate: PrefixGate | str,
) -> torch.Tensor:  # [batch] int64: K^
    """``K^ = max{k <= n : B_k >= eta_b and C_k >= eta_c}``, 0 if none (paper eq. 3).

    ``B_k = min_{j<=k} q_j`` (local gate). ``C_k`` per ``prefix_gate``: geometric mean of
    ``q_1..q_k`` (raw confidence), ``min_{j<=k} q_j`` (marginal survival), or
    ``prod_{j<=k} q_j`` computed as ``sum log q_j >= log eta_c`` (conditional survival).
    The maximum is taken literally: for the geometric mean, whose ``C_k`` need not fall
    with ``k``, a larger ``k`` can be feasible after a smaller one is not. A NaN score fails
    both gates at its position and every later one.
    """
    _check_eta("eta_b", eta_b)
    _check_eta("eta_c", eta_c)
    gate = PrefixGate(prefix_gate)
    # float64 keeps long log-space sums exact; NaN -> -inf so it fails every later gate.
    scores = scores.to(torch.float64).nan_to_num(nan=-math.inf, posinf=math.inf)
    block = scores.shape[-1]
    local = torch.cummin(scores, dim=-1).values  # [batch, block]
    prefix = _prefix_gate_scores(scores, gate)  # [batch, block]
    eta_c_cmp = prefix_threshold(gate, eta_c)
    positions = torch.arange(block, device=scores.device)  # [block]
    in_range = positions[None, :] < num_draft_tokens[:, None]  # [batch, block]
    feasible = (local >= eta_b) & (prefix >= eta_c_cmp) & in_range  # [batch, block]
    lengths = (positions + 1)[None, :]  # [1, block]
    return torch.where(feasible, lengths, NO_FEASIBLE_PREFIX).amax(dim=-1).to(torch.int64)


def _check_eta(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:  # also rejects NaN
        raise ValueError(f"{name} must lie in [0, 1], got {value}")


@dataclass(frozen=True)
class GuardFlags:
    """Which guards block a skip, per row (True = this guard forbids skipping)."""

    # [batch] bool: a special token (EOS included) among x_1..x_K^
    special_token: torch.Tensor
    # [batch] bool: x_1..x_K^ contains a repetition (see guard_flags)
    repetition: torch.Tensor
    # [batch] bool: a score of the valid block is non-finite or outside [0, 1]
    invalid_scores: torch.Tensor
    # [batch] bool: the block is the shortened final block of the request
    shortened_block: torch.Tensor

    @property
    def passed(self) -> torch.Tensor:  # [batch] bool
        """True where no guard blocks a skip."""
        blocked = self.special_token | self.repetition | self.invalid_scores
        return ~(blocked | self.shortened_block)

    @classmethod
    def make_dummy(cls, batch: int = 2) -> GuardFlags:
        """Flags that block nothing."""
        clear = torch.zeros(batch, dtype=torch.bool)  # [batch]
        return cls(clear, clear.clone(), clear.clone(), clear.clone())


def guard_flags(
    # [batch, block] int64: x_1..x_gamma
    draft_token_ids: torch.Tensor,
    # [batch, block] float: q_1..q_gamma
    scores: torch.Tensor,
    # [batch] int64: feasible prefix length
    K_hat: torch.Tensor,
    # [num_tokens] int64 (or a list of ints): special token ids, EOS included
    special_token_ids: torch.Tensor | list[int],
    # [batch] int64 (or an int for all rows): tokens the request may still generate
    max_new_tokens_left: torch.Tensor | int,
    repetition_ngram: int = DEFAULT_REPETITION_NGRAM,
    repetition_min_repeats: int = DEFAULT_REPETITION_MIN_REPEATS,
    *,
    # [batch] int64 or None: valid draft length; None means the full block
    num_draft_tokens: torch.Tensor | None = None,
) -> GuardFlags:
    """Evaluate the skip guards of the paper (§4.1, appendix A.6) for each row.

    - special_token: some ``x_j``, ``j <= K^``, is in ``special_token_ids``.
    - repetition **(project choice)**: ``x_1..x_K^`` contains a contiguous span that is one
      n-gram, ``1 <= n <= repetition_ngram``, repeated back to back at least
      ``repetition_min_repeats`` times. With the defaults (4, 4): ``a a a a``, ``a b a b a b
      a b``, ... up to a 4-gram repeated 4 times. Only the candidate prefix is inspected.
    - invalid_scores: some ``q_j`` of the valid block (``j <= num_draft_tokens``, all of it
      when that is None) is non-finite or outside ``[0, 1]``. The whole block is checked
      because a NaN already ends ``K^`` before itself and would go unseen in the prefix.
    - shortened_block **(project choice)**: ``max_new_tokens_left < block`` (the generation
      limit cuts this draft short) or ``num_draft_tokens < block``.
    """
    if repetition_ngram < 1 or repetition_min_repeats < 2:
        raise ValueError(
            "repetition_ngram must be >= 1 and repetition_min_repeats >= 2, "
            f"got {repetition_ngram} and {repetition_min_repeats}"
        )
    batch, block = draft_token_ids.shape
    device = draft_token_ids.device
    positions = torch.arange(block, device=device)  # [block]
    in_prefix = positions[None, :] < K_hat[:, None]  # [batch, block]
    special = torch.as_tensor(special_token_ids, dtype=torch.int64, device=device)  # [num_tokens]
    is_special = torch.isin(draft_token_ids, special)  # [batch, block]
    valid_len = num_draft_tokens  # [batch]
    if valid_len is None:
        valid_len = torch.full((batch,), block, dtype=torch.int64, device=device)
    in_block = positions[None, :] < valid_len[:, None]  # [batch, block]
    bad_score = ~(torch.isfinite(scores) & (scores >= 0) & (scores <= 1))  # [batch, block]
    left = torch.as_tensor(max_new_tokens_left, device=device).expand(batch)  # [batch]
    return GuardFlags(
        special_token=(is_special & in_prefix).any(dim=-1),
        repetition=_has_repetition(
            draft_token_ids, K_hat, repetition_ngram, repetition_min_repeats
        ),
        invalid_scores=(bad_score & in_block).any(dim=-1),
        shortened_block=(left < block) | (valid_len < block),
    )


def _has_repetition(
    # [batch, block] int64
    draft_token_ids: torch.Tensor,
    # [batch] int64
    K_hat: torch.Tensor,
    max_ngram: int,
    min_repeats: int,
) -> torch.Tensor:  # [batch] bool
    # A period-p repetition repeated r times is a run of (r - 1) * p consecutive positions i
    # with x_i == x_{i-p}, all inside the prefix. The loop runs over periods, not rows.
    batch, block = draft_token_ids.shape
    device = draft_token_ids.device
    found = torch.zeros(batch, dtype=torch.bool, device=device)  # [batch]
    for p in range(1, min(max_ngram, block // min_repeats) + 1):  # p: the n-gram length
        index = torch.arange(p, block, device=device)  # [block - p]
        same = draft_token_ids[:, p:] == draft_token_ids[:, :-p]  # [batch, block - p]
        same &= index[None, :] < K_hat[:, None]  # both x_i and x_{i-p} inside the prefix
        # run length ending at i = i - (last index <= i where `same` is False)
        breaks = torch.where(same, -1, index[None, :])  # [batch, block - p]
        last_break = torch.cummax(breaks, dim=-1).values.clamp(min=p - 1)  # [batch, block - p]
        run = index[None, :] - last_break  # [batch, block - p]
        found |= (run >= (min_repeats - 1) * p).any(dim=-1)
    return found


@dataclass(frozen=True)
class SkipDecision:
    """The policy's choice for each row of one round."""

    # [batch] bool: commit x_1..x_K^ without calling the verifier
    skip: torch.Tensor
    # [batch] bool: a strict round forced by staleness (D >= S_max)
    forced_strict: torch.Tensor
    # [batch] int64: draft tokens committed by the skip (K^), 0 on a strict round
    num_committed: torch.Tensor
    # [batch] int64: D after this round (D + K^ on a skip, 0 after a verifier call)
    unverified_after: torch.Tensor

    @classmethod
    def make_dummy(cls, batch: int = 2) -> SkipDecision:
        """Every row strict, nothing forced."""
        no = torch.zeros(batch, dtype=torch.bool)  # [batch]
        zero = torch.zeros(batch, dtype=torch.int64)  # [batch]
        return cls(no, no.clone(), zero, zero.clone())


@dataclass(frozen=True)
class SkipPolicy:
    """Verifier-skipping configuration (paper §4.1; defaults from appendix A.6)."""

    K_min: int = 6  # shortest worthwhile skip: below it extra draft blocks cost more (eq. 8)
    S_max: int = 64  # staleness limit on unverified tokens (transfer runs: 24/32)
    eta_b: float = 0.90  # local gate threshold, paper's raw-confidence setting
    eta_c: float = 0.93  # prefix gate threshold, paper's raw-confidence setting
    gate: PrefixGate = PrefixGate.GEOMETRIC_MEAN  # raw confidence

    def __post_init__(self) -> None:
        if self.K_min < 0:  # K_min = 0 is the paper's diagnostic: only K^ > 0 remains
            raise ValueError(f"K_min must be >= 0, got {self.K_min}")
        if self.S_max < 1:
            raise ValueError(f"S_max must be >= 1, got {self.S_max}")
        _check_eta("eta_b", self.eta_b)
        _check_eta("eta_c", self.eta_c)
        allowed = [g.value for g in PrefixGate]
        if self.gate not in allowed:  # str-valued enum: members compare equal to their values
            raise ValueError(f"gate must be one of {allowed}, got {self.gate!r}")
        object.__setattr__(self, "gate", PrefixGate(self.gate))

    def feasible_prefix(
        self,
        # [batch, block] float
        scores: torch.Tensor,
        # [batch] int64
        num_draft_tokens: torch.Tensor,
    ) -> torch.Tensor:  # [batch] int64: K^
        return feasible_prefix(scores, num_draft_tokens, self.eta_b, self.eta_c, self.gate)

    def decide(
        self,
        # [batch] int64: K^
        K_hat: torch.Tensor,
        # [batch] int64: D, unverified tokens committed since the last verifier call
        unverified: torch.Tensor,
        # GuardFlags, or [batch] bool: True where every guard passes
        guards: GuardFlags | torch.Tensor,
    ) -> SkipDecision:
        """Skip iff ``D < S_max and K^ > 0 and K^ >= K_min and guards pass`` (paper §4.1)."""
        guards_passed = guards.passed if isinstance(guards, GuardFlags) else guards
        forced = unverified >= self.S_max  # [batch]
        skip = ~forced & (K_hat > 0) & (K_hat >= self.K_min) & guards_passed  # [batch]
        num_committed = torch.where(skip, K_hat, 0)  # [batch]
        return SkipDecision(
            skip=skip,
            forced_strict=forced,
            num_committed=num_committed,
            unverified_after=torch.where(skip, unverified + K_hat, 0),
        )
