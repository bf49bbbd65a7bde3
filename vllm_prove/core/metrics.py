"""Measurement: committed tokens per cycle, AR-matching prefix, AUC, throughput, SDD agreement.

Conventions (docs/METHODS.md §8): throughput is total tokens over total seconds, never a mean of
per-request rates; committed tokens per cycle are reported as a mean and as a histogram
(gpt-fast's ``accept_counts``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vllm_prove.core.contracts import Verdict
from vllm_prove.core.rules import accepted_prefix_length

CountsLike = torch.Tensor | Sequence[int]


def _as_1d(
    name: str,
    # any shape; flattened
    values: torch.Tensor | Sequence[float],
    dtype: torch.dtype,
) -> torch.Tensor:  # [num_tokens] on the CPU
    tensor = torch.as_tensor(values, dtype=dtype).detach().cpu().flatten()  # [num_tokens]
    if tensor.numel() == 0:
        raise ValueError(f"{name} is empty")
    return tensor


def committed_histogram(
    # [batch]: tokens committed, one entry per row and cycle
    committed_counts: CountsLike,
) -> dict[int, int]:
    """Histogram ``{tokens committed in a cycle: number of cycles}``, sorted by length."""
    counts = _as_1d("committed_counts", committed_counts, torch.int64).tolist()
    return dict(sorted(Counter(counts).items()))


def mean_committed_per_cycle(
    # [batch]: tokens committed, one entry per row and cycle
    committed_counts: CountsLike,
) -> float:
    """Mean tokens committed per cycle (per row and cycle, one entry each)."""
    return float(_as_1d("committed_counts", committed_counts, torch.float64).mean())


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens two token sequences share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def ar_matching_prefix_length(
    # [batch, block] int64: the proposed block y_1..y_B
    draft_token_ids: torch.Tensor,
    # [batch] int64: valid draft length per row
    num_draft_tokens: torch.Tensor,
    # [batch, >= block] int64: the proposer's greedy AR continuation of the same context
    ar_token_ids: torch.Tensor,
) -> torch.Tensor:  # [batch] int64
    """Longest prefix of the block equal to the greedy AR continuation (ProVe §3.1)."""
    block = draft_token_ids.shape[1]
    if ar_token_ids.shape[1] < block:
        raise ValueError(
            f"ar_token_ids needs at least block={block} columns, got {ar_token_ids.shape[1]}"
        )
    matches = draft_token_ids == ar_token_ids[:, :block]  # [batch, block]
    return accepted_prefix_length(matches, num_draft_tokens)


def auc(
    # [num_tokens] float: higher = more likely positive
    scores: torch.Tensor | Sequence[float],
    # [num_tokens] bool or {0, 1}
    labels: torch.Tensor | Sequence[int],
) -> float:
    """ROC AUC as the Mann-Whitney rank statistic; tied scores share their average rank.

    ``AUC = (sum of positive ranks - P (P + 1) / 2) / (P N)``: the probability that a random
    positive scores above a random negative, ties counting one half.
    """
    s = _as_1d("scores", scores, torch.float64)  # [num_tokens]
    y = _as_1d("labels", labels, torch.float64)  # [num_tokens]
    if s.numel() != y.numel():
        raise ValueError(f"scores and labels differ in length: {s.numel()} vs {y.numel()}")
    if not torch.isfinite(s).all():
        raise ValueError("scores contain NaN or infinite values")
    if not ((y == 0) | (y == 1)).all():
        raise ValueError("labels must be 0/1 or bool")
    positive = y == 1  # [num_tokens]
    num_pos = int(positive.sum())
    num_neg = y.numel() - num_pos
    if num_pos == 0 or num_neg == 0:
        only = "positive" if num_neg == 0 else "negative"
        raise ValueError(f"AUC needs both classes; all {y.numel()} labels are {only}")
    _, inverse, counts = torch.unique(s, return_inverse=True, return_counts=True)  # sorted
    first_rank = torch.cumsum(counts, 0) - counts + 1  # [num_unique] 1-based rank of group start
    average_rank = first_rank + (counts - 1) / 2  # [num_unique]
    rank_sum = average_rank[inverse][positive].sum()
    u_statistic = rank_sum - num_pos * (num_pos + 1) / 2
    return float(u_statistic / (num_pos * num_neg))


def throughput(total_tokens: int | float, total_seconds: float) -> float:
    """Tokens per second: total generated tokens / total in-flight seconds (docs/METHODS.md §8)."""
    if total_seconds <= 0:
        raise ValueError(f"total_seconds must be > 0, got {total_seconds}")
    if total_tokens < 0:
        raise ValueError(f"total_tokens must be >= 0, got {total_tokens}")
    return float(total_tokens) / float(total_seconds)


def _relaxed_rounds(
    # [batch]: K_b per round
    committed_lengths: CountsLike,
    # [batch]: L_b per round
    strict_lengths: CountsLike,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([batch], [batch]) int64, rounds with K_b > 0
    # Rounds play the role of the batch: one entry per round b.
    relaxed = _as_1d("committed_lengths", committed_lengths, torch.int64)  # [batch]: K_b
    strict = _as_1d("strict_lengths", strict_lengths, torch.int64)  # [batch]: L_b
    if relaxed.numel() != strict.numel():
        raise ValueError(f"K and L differ in length: {relaxed.numel()} vs {strict.numel()}")
    nonempty = relaxed > 0  # the set A: rounds committing a nonempty relaxed prefix
    if not nonempty.any():
        raise ValueError("no round committed a nonempty relaxed prefix (all K_b == 0)")
    return relaxed[nonempty], strict[nonempty]


def strict_token_agreement(
    # [batch]: K_b, committed relaxed prefix per round (0 on strict rounds)
    committed_lengths: CountsLike,
    # [batch]: L_b, prefix strict verification accepts from the same block
    strict_lengths: CountsLike,
) -> float:
    """StrictToken = ``sum_b min(K_b, L_b) / sum_b K_b`` over rounds with ``K_b > 0`` (§7).

    ``K_b``: relaxed prefix committed in round b; ``L_b``: what strict verification accepts.
    """
    relaxed, strict = _relaxed_rounds(committed_lengths, strict_lengths)  # [batch] each
    return float(torch.minimum(relaxed, strict).sum() / relaxed.sum())


def full_prefix_acceptance(
    # [batch]: K_b
    committed_lengths: CountsLike,
    # [batch]: L_b
    strict_lengths: CountsLike,
) -> float:
    """FullPrefix = ``mean_b 1{K_b <= L_b}`` over rounds with ``K_b > 0`` (docs/METHODS.md §7)."""
    relaxed, strict = _relaxed_rounds(committed_lengths, strict_lengths)  # [batch] each
    return float((relaxed <= strict).double().mean())


@dataclass
class CycleStats:
    """Accumulates tokens committed per cycle and wall time. Mutable: ``record`` appends."""

    committed_counts: list[int] = field(default_factory=list)  # mutable: one entry per row-cycle
    total_seconds: float = 0.0  # mutable: in-flight seconds added by the caller

    def record(self, verdict: Verdict) -> None:
        """Add one cycle: ``num_emitted`` of every row."""
        self.committed_counts.extend(verdict.num_emitted.tolist())

    def record_counts(
        self,
        # [batch]: tokens committed per row in one or more cycles
        committed_counts: CountsLike,
    ) -> None:
        self.committed_counts.extend(torch.as_tensor(committed_counts).flatten().tolist())

    def add_time(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        self.total_seconds += seconds

    def summary(self) -> dict[str, object]:
        """``cycles``, ``total_tokens``, ``mean_committed_per_cycle``, ``histogram`` and,
        once time was recorded, ``tokens_per_second``."""
        total = sum(self.committed_counts)
        counts = self.committed_counts
        result: dict[str, object] = {
            "cycles": len(counts),
            "total_tokens": total,
            "mean_committed_per_cycle": mean_committed_per_cycle(counts) if counts else 0.0,
            "histogram": committed_histogram(counts) if counts else {},
        }
        if self.total_seconds > 0:
            result["tokens_per_second"] = throughput(total, self.total_seconds)
        return result
