"""Typed contracts between the stages of one cycle: a block proposal and a verdict.

Both are frozen dataclasses of batched, padded tensors. A row may carry fewer draft tokens
than the block holds (``num_draft_tokens``); positions past that length are padding and no
rule reads them. The verdict uses vLLM's output layout (``RejectionSampler.forward``):
``[batch, block + 1]`` token ids, padded at the tail with ``PLACEHOLDER_TOKEN_ID``.

Vocabulary (vLLM ``v1/sample/rejection_sampler.py``): *accepted* tokens are draft tokens
committed as they are; a *recovered* token is the verifier's correction at the first
rejected position; a *bonus* token is the verifier's next token after a fully accepted block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# vLLM pads ``output_token_ids`` with -1 (``rejection_sampler.PLACEHOLDER_TOKEN_ID``).
PLACEHOLDER_TOKEN_ID = -1


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")


@dataclass(frozen=True)
class BlockProposal:
    """One propose pass: a block of draft tokens and the proposer's confidence in each.

    ``draft_token_ids[:, i]`` is ``y_{i+1}`` and ``proposer_probs[:, i]`` is ``p~_{i+1}``, the
    max softmax of the proposer at that output (docs/METHODS.md §1).
    """

    # [batch, block] int64: y_1..y_B, padded past num_draft_tokens
    draft_token_ids: torch.Tensor
    # [batch, block] float32: p~_1..p~_B, padded past num_draft_tokens
    proposer_probs: torch.Tensor
    # [batch] int64: valid draft length per row, 1..block
    num_draft_tokens: torch.Tensor

    def __post_init__(self) -> None:
        # Shape checks only: value checks would force a device sync on every cycle.
        if self.draft_token_ids.dim() != 2:
            raise ValueError(
                f"draft_token_ids must be [batch, block], got {tuple(self.draft_token_ids.shape)}"
            )
        batch, block = self.draft_token_ids.shape
        _check_shape("proposer_probs", self.proposer_probs, (batch, block))
        _check_shape("num_draft_tokens", self.num_draft_tokens, (batch,))

    @property
    def batch_size(self) -> int:
        return self.draft_token_ids.shape[0]

    @property
    def block_size(self) -> int:
        return self.draft_token_ids.shape[1]

    @classmethod
    def make_dummy(cls, batch: int = 2, block: int = 4, seed: int = 0) -> BlockProposal:
        """A random, valid proposal with ragged rows; padding holds PLACEHOLDER_TOKEN_ID, 0.0."""
        gen = torch.Generator().manual_seed(seed)
        num_draft_tokens = torch.randint(1, block + 1, (batch,), generator=gen)  # [batch]
        valid = torch.arange(block)[None, :] < num_draft_tokens[:, None]  # [batch, block]
        tokens = torch.randint(0, 100, (batch, block), generator=gen)  # [batch, block]
        probs = torch.rand((batch, block), generator=gen)  # [batch, block]
        return cls(
            draft_token_ids=torch.where(valid, tokens, PLACEHOLDER_TOKEN_ID),
            proposer_probs=torch.where(valid, probs, 0.0),
            num_draft_tokens=num_draft_tokens,
        )


@dataclass(frozen=True)
class Verdict:
    """What one cycle commits: accepted draft tokens, then at most one verifier token.

    Invariants: row ``r`` holds ``num_emitted[r]`` real tokens followed only by
    ``PLACEHOLDER_TOKEN_ID``; ``num_emitted = num_accepted + (1 if a recovered or bonus token
    was appended else 0)``; the first ``num_accepted[r]`` tokens are the draft's own.
    """

    # [batch] int64: number of DRAFT tokens committed
    num_accepted: torch.Tensor
    # [batch, block + 1] int64: tokens to emit, padded with PLACEHOLDER_TOKEN_ID (vLLM layout)
    output_token_ids: torch.Tensor
    # [batch] int64: number of non-placeholder entries of output_token_ids
    num_emitted: torch.Tensor

    def __post_init__(self) -> None:
        if self.output_token_ids.dim() != 2:
            raise ValueError(
                "output_token_ids must be [batch, block + 1], "
                f"got {tuple(self.output_token_ids.shape)}"
            )
        batch = self.output_token_ids.shape[0]
        _check_shape("num_accepted", self.num_accepted, (batch,))
        _check_shape("num_emitted", self.num_emitted, (batch,))

    @property
    def batch_size(self) -> int:
        return self.output_token_ids.shape[0]

    @property
    def block_size(self) -> int:
        return self.output_token_ids.shape[1] - 1

    def to_lists(self) -> list[list[int]]:
        """Emitted token ids per row, placeholders dropped (syncs with the device)."""
        rows = self.output_token_ids.tolist()
        counts = self.num_emitted.tolist()
        return [row[:count] for row, count in zip(rows, counts)]

    @classmethod
    def from_prefix(
        cls,
        # [batch, block] int64
        draft_token_ids: torch.Tensor,
        # [batch] int64: draft tokens to commit per row, 0..block
        num_accepted: torch.Tensor,
        # [batch] int64 or None: recovered/bonus token appended after the accepted prefix
        extra_token_ids: torch.Tensor | None = None,
    ) -> Verdict:
        """Lay out ``y_1..y_a`` (+ one verifier token) in vLLM's padded output format."""
        batch, block = draft_token_ids.shape
        device = draft_token_ids.device
        pad_column = torch.full((batch, 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
        draft = draft_token_ids.to(torch.int64)  # [batch, block]
        padded = torch.cat([draft, pad_column], dim=1)  # [batch, block + 1]
        positions = torch.arange(block + 1, device=device)  # [block + 1]
        keep = positions[None, :] < num_accepted[:, None]  # [batch, block + 1]
        output = torch.where(keep, padded, PLACEHOLDER_TOKEN_ID)  # [batch, block + 1]
        num_accepted = num_accepted.to(torch.int64)
        if extra_token_ids is None:
            return cls(num_accepted, output, num_accepted.clone())
        output = output.scatter(1, num_accepted[:, None], extra_token_ids.to(torch.int64)[:, None])
        return cls(num_accepted, output, num_accepted + 1)

    @classmethod
    def make_dummy(cls, batch: int = 2, block: int = 4, seed: int = 0) -> Verdict:
        """A random, valid verdict: a random accepted prefix plus one bonus/recovered token."""
        gen = torch.Generator().manual_seed(seed)
        draft_token_ids = torch.randint(0, 100, (batch, block), generator=gen)  # [batch, block]
        num_accepted = torch.randint(0, block + 1, (batch,), generator=gen)  # [batch]
        extra = torch.randint(0, 100, (batch,), generator=gen)  # [batch]
        return cls.from_prefix(draft_token_ids, num_accepted, extra)
