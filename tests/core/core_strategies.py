"""Hypothesis strategies and helpers shared by the tests of ``vllm_prove.core``."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st

from vllm_prove.core import PLACEHOLDER_TOKEN_ID, BlockProposal, Verdict

# Small and deadline-free: the CPU is shared with a training job.
FAST = settings(max_examples=60, deadline=None)

MAX_BATCH = 4
MAX_BLOCK = 8
SMALL_VOCAB = 4  # few token ids, so that draft and target often agree

probabilities = st.floats(min_value=0.0, max_value=1.0, allow_nan=False, width=32)


@st.composite
def ragged_shapes(draw) -> tuple[int, int, list[int]]:
    batch = draw(st.integers(1, MAX_BATCH))
    block = draw(st.integers(1, MAX_BLOCK))
    lengths = draw(st.lists(st.integers(1, block), min_size=batch, max_size=batch))
    return batch, block, lengths


@st.composite
def proposals_and_verifier_probs(draw) -> tuple[BlockProposal, torch.Tensor]:
    """A ragged proposal and verifier probabilities q of the same shape."""
    batch, block, lengths = draw(ragged_shapes())
    cells = batch * block
    tokens = draw(st.lists(st.integers(0, SMALL_VOCAB - 1), min_size=cells, max_size=cells))
    p = draw(st.lists(probabilities, min_size=cells, max_size=cells))
    q = draw(st.lists(probabilities, min_size=cells, max_size=cells))
    proposal = BlockProposal(
        draft_token_ids=torch.tensor(tokens).view(batch, block),
        proposer_probs=torch.tensor(p, dtype=torch.float32).view(batch, block),
        num_draft_tokens=torch.tensor(lengths),
    )
    return proposal, torch.tensor(q, dtype=torch.float32).view(batch, block)


@st.composite
def drafts_and_targets(draw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """draft [batch, block], num_draft_tokens [batch], target [batch, block + 1], small vocab."""
    batch, block, lengths = draw(ragged_shapes())
    draft = draw(st.lists(st.integers(0, SMALL_VOCAB - 1), min_size=batch * block,
                          max_size=batch * block))
    target = draw(st.lists(st.integers(0, SMALL_VOCAB - 1), min_size=batch * (block + 1),
                           max_size=batch * (block + 1)))
    return (
        torch.tensor(draft).view(batch, block),
        torch.tensor(lengths),
        torch.tensor(target).view(batch, block + 1),
    )


@st.composite
def drafts_and_logits(draw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """draft [batch, block], num_draft_tokens [batch], logits [batch, block + 1, vocab]."""
    batch, block, lengths = draw(ragged_shapes())
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    draft = torch.randint(0, SMALL_VOCAB, (batch, block), generator=gen)
    logits = torch.randn((batch, block + 1, SMALL_VOCAB), generator=gen)
    return draft, torch.tensor(lengths), logits


def assert_verdict_invariants(verdict: Verdict) -> None:
    """num_emitted counts the non-placeholders, which form a prefix of every row."""
    real = verdict.output_token_ids != PLACEHOLDER_TOKEN_ID  # [batch, block + 1]
    assert torch.equal(real.sum(dim=1), verdict.num_emitted)
    positions = torch.arange(verdict.block_size + 1)
    assert torch.equal(real, positions[None, :] < verdict.num_emitted[:, None])
    assert bool(((verdict.num_emitted - verdict.num_accepted) >= 0).all())
    assert bool(((verdict.num_emitted - verdict.num_accepted) <= 1).all())
