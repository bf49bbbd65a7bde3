"""The contracts: shape validation, dummies, vLLM's padded output layout."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from core_strategies import assert_verdict_invariants

from vllm_prove.core import PLACEHOLDER_TOKEN_ID, BlockProposal, Verdict


def test_placeholder_is_vllms_padding():
    assert PLACEHOLDER_TOKEN_ID == -1  # vllm/v1/sample/rejection_sampler.py


def test_block_proposal_dummy_is_valid_and_ragged():
    proposal = BlockProposal.make_dummy(batch=6, block=5, seed=3)
    assert (proposal.batch_size, proposal.block_size) == (6, 5)
    lengths = proposal.num_draft_tokens
    assert bool(((lengths >= 1) & (lengths <= 5)).all())
    padding = torch.arange(5)[None, :] >= lengths[:, None]
    assert bool((proposal.draft_token_ids[padding] == PLACEHOLDER_TOKEN_ID).all())
    assert bool((proposal.draft_token_ids[~padding] >= 0).all())
    assert torch.equal(BlockProposal.make_dummy(seed=1).draft_token_ids,
                       BlockProposal.make_dummy(seed=1).draft_token_ids)


def test_block_proposal_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="proposer_probs"):
        BlockProposal(torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 3), torch.ones(2))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        BlockProposal(torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 4), torch.ones(3))
    with pytest.raises(ValueError, match="draft_token_ids"):
        BlockProposal(torch.zeros(4, dtype=torch.int64), torch.zeros(4), torch.ones(1))


def test_contracts_are_frozen():
    proposal = BlockProposal.make_dummy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        proposal.num_draft_tokens = torch.ones(2)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        Verdict.make_dummy().num_accepted = torch.ones(2)  # type: ignore[misc]


def test_verdict_from_prefix_layout():
    draft = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    accepted = torch.tensor([0, 2, 3])
    plain = Verdict.from_prefix(draft, accepted)
    assert plain.output_token_ids.tolist() == [[-1, -1, -1, -1], [20, 21, -1, -1],
                                               [30, 31, 32, -1]]
    assert plain.num_emitted.tolist() == [0, 2, 3]
    with_extra = Verdict.from_prefix(draft, accepted, torch.tensor([7, 8, 9]))
    assert with_extra.output_token_ids.tolist() == [[7, -1, -1, -1], [20, 21, 8, -1],
                                                    [30, 31, 32, 9]]
    assert with_extra.num_emitted.tolist() == [1, 3, 4]
    assert with_extra.to_lists() == [[7], [20, 21, 8], [30, 31, 32, 9]]
    assert with_extra.block_size == 3


def test_verdict_dummy_satisfies_invariants():
    for seed in range(5):
        verdict = Verdict.make_dummy(batch=3, block=6, seed=seed)
        assert verdict.output_token_ids.shape == (3, 7)
        assert_verdict_invariants(verdict)


def test_verdict_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="num_emitted"):
        Verdict(torch.zeros(2, dtype=torch.int64), torch.zeros(2, 5, dtype=torch.int64),
                torch.zeros(3, dtype=torch.int64))
