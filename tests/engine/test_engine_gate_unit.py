"""The gated modes' glue (vllm_prove/engine/gate.py) against the core, without an engine."""

from __future__ import annotations

import pytest
import torch

from vllm_prove.core import rules
from vllm_prove.core.contracts import PLACEHOLDER_TOKEN_ID, BlockProposal
from vllm_prove.core.rules import GateKind
from vllm_prove.engine import gate

MASK = 1


def _dummy_metadata(num_drafts: list[int]):
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    return SpecDecodeMetadata.make_dummy([[MASK] * n for n in num_drafts], device=torch.device("cpu"))


def test_verifier_input_replaces_each_mask_by_the_proposal_before_it():
    # Two requests scheduled back to back: [7, 8, u=9, m, m] and [u=5, m]; rows are u and masks.
    input_ids = torch.tensor([7, 8, 9, MASK, MASK, 5, MASK])  # [num_tokens]
    logits_indices = torch.tensor([2, 3, 4, 5, 6])  # [num_rows]: token index of each row
    target_logits_indices = torch.tensor([0, 1, 3])  # [num_drafts]: the row before each mask
    y = torch.tensor([40, 41, 42, 50, 51])  # [num_rows]: y_1..y_B per request
    ids = gate.verifier_input_ids(input_ids, y, logits_indices, target_logits_indices)
    assert ids.tolist() == [7, 8, 9, 40, 41, 5, 50]  # u, y_1, y_2 | u, y_1
    assert input_ids.tolist() == [7, 8, 9, MASK, MASK, 5, MASK]  # the step's own ids untouched


def test_vllm_layout_matches_the_gate_layout():
    # vLLM's own metadata: n drafts per request give n + 1 logits rows, cumulated in
    # cu_num_sampled_tokens, the block lengths of the gate.
    md = _dummy_metadata([3, 0, 2])
    assert md.cu_num_sampled_tokens.tolist() == [4, 5, 8]
    assert md.max_spec_len + 1 == 4


@pytest.mark.parametrize("kind", list(GateKind))
def test_window_gate_equals_the_core_rule(kind):
    gen = torch.Generator().manual_seed(0)
    block_lengths = [4, 1, 3, 4]
    num_rows = sum(block_lengths)
    y = torch.randint(2, 100, (num_rows,), generator=gen)  # [num_rows]
    p = torch.rand(num_rows, generator=gen)  # [num_rows]
    q = torch.rand(num_rows, generator=gen)  # [num_rows]
    cu = torch.tensor(block_lengths).cumsum(0).to(torch.int32)  # [batch]
    threshold = 0.2
    verdict = gate.apply_window_gate(kind, threshold, y, p, q, cu, max_block=4)
    # The same rule on the padded layout, row by row.
    starts = [0, 4, 5, 8]
    for r, (start, n) in enumerate(zip(starts, block_lengths)):
        pad = 4 - n
        proposal = BlockProposal(
            torch.cat([y[start:start + n], torch.full((pad,), PLACEHOLDER_TOKEN_ID)])[None],
            torch.cat([p[start:start + n], torch.zeros(pad)])[None], torch.tensor([n]),
        )
        q_row = torch.cat([q[start:start + n], torch.zeros(pad)])[None]
        expected = rules.apply_gate(kind, proposal, q_row, threshold)
        assert verdict.to_lists()[r] == expected.to_lists()[0]


def test_gate_emits_only_proposals_and_always_y1():
    y = torch.tensor([11, 12, 13, 21, 22])  # two blocks: 3 and 2 tokens
    p = torch.tensor([0.01, 0.9, 0.9, 0.01, 0.01])
    q = torch.tensor([0.01, 0.9, 0.1, 0.9, 0.9])
    cu = torch.tensor([3, 5], dtype=torch.int32)
    verdict = gate.apply_window_gate(GateKind.PRODUCT, 0.5, y, p, q, cu, max_block=3)
    # block 1: s_2 = 0.81 passes, s_3 = 0.09 fails; block 2: s_2 = 0.009 fails; y_1 always.
    assert verdict.to_lists() == [[11, 12], [21]]
    out = gate.sampled_token_ids(verdict, max_spec_len=2)
    assert out.dtype == torch.int32 and out.tolist() == [[11, 12, PLACEHOLDER_TOKEN_ID], [21, PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID]]


def test_proposals_are_argmax_and_max_softmax():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    y, p = gate.propose_from_window(logits)
    assert y.tolist() == [1, 0]
    torch.testing.assert_close(p, torch.softmax(logits, -1).max(-1).values)
