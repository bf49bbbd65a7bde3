"""Golden cases for every acceptance rule, from hand-made probabilities and logits."""

from __future__ import annotations

import pytest
import torch

from vllm_prove.core import (
    GATES,
    BlockProposal,
    GateKind,
    accepted_prefix_length,
    apply_gate,
    lenient_accept,
    lossless_greedy,
    product_gate,
    proposer_only_gate,
    strict_greedy,
    topk_accept,
    verifier_only_gate,
)

PH = -1  # PLACEHOLDER_TOKEN_ID, spelled out so a change of the sentinel shows here

# Hand-made block from the brief: s = p~ * q = [.18, .45, .04, .81].
P_TILDE = [0.9, 0.5, 0.4, 0.9]
Q = [0.2, 0.9, 0.1, 0.9]
DRAFT = [11, 12, 13, 14]


def _proposal(draft, probs, lengths) -> BlockProposal:
    return BlockProposal(
        draft_token_ids=torch.tensor(draft),
        proposer_probs=torch.tensor(probs, dtype=torch.float32),
        num_draft_tokens=torch.tensor(lengths),
    )


def test_accepted_prefix_length_limits_and_min_accept():
    passed = torch.tensor([[True, True, False, True], [False, True, True, True],
                           [True, True, True, True]])
    lengths = torch.tensor([4, 4, 2])
    assert accepted_prefix_length(passed, lengths).tolist() == [2, 0, 2]
    # a forced first position lets row 1 continue through its passing positions 2..4
    assert accepted_prefix_length(passed, lengths, min_accept=1).tolist() == [2, 4, 2]
    # min_accept never reaches past num_draft_tokens
    assert accepted_prefix_length(passed, torch.tensor([1, 1, 1]), min_accept=3).tolist() == [
        1, 1, 1]


def test_product_gate_brief_example():
    verdict = product_gate(_proposal([DRAFT], [P_TILDE], [4]), torch.tensor([Q]), theta=0.3)
    assert verdict.num_accepted.tolist() == [2]
    assert verdict.output_token_ids.tolist() == [[11, 12, PH, PH, PH]]
    assert verdict.num_emitted.tolist() == [2]


def test_product_gate_ignores_first_score_and_stops_at_first_failure():
    # s_1 = .18 < theta, yet y_1 is committed; s_3 fails, s_4 passing again does not matter.
    verdict = product_gate(_proposal([DRAFT], [P_TILDE], [4]), torch.tensor([Q]), theta=0.1)
    assert verdict.num_accepted.tolist() == [2]
    verdict = product_gate(_proposal([DRAFT], [P_TILDE], [4]), torch.tensor([Q]), theta=0.01)
    assert verdict.output_token_ids.tolist() == [[11, 12, 13, 14, PH]]
    verdict = product_gate(_proposal([DRAFT], [P_TILDE], [4]), torch.tensor([Q]), theta=0.5)
    assert verdict.output_token_ids.tolist() == [[11, PH, PH, PH, PH]]


def test_product_gate_ragged_rows():
    proposal = _proposal(
        [[1, 2, 3, 4], [5, 6, PH, PH], [7, PH, PH, PH]],
        [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]],
        [4, 2, 1],
    )
    verifier_probs = torch.ones(3, 4)
    verdict = product_gate(proposal, verifier_probs, theta=0.5)
    assert verdict.num_accepted.tolist() == [4, 2, 1]  # all pass / all of 2 / n = 1
    assert verdict.output_token_ids.tolist() == [
        [1, 2, 3, 4, PH], [5, 6, PH, PH, PH], [7, PH, PH, PH, PH]]
    # padding past num_draft_tokens is never committed even if its score passes
    padded_pass = _proposal([[5, 6, 9, 9]], [[1.0, 1.0, 1.0, 1.0]], [2])
    assert product_gate(padded_pass, torch.ones(1, 4), 0.5).num_accepted.tolist() == [2]


def test_verifier_only_gate():
    proposal = _proposal([DRAFT], [P_TILDE], [4])
    assert verifier_only_gate(proposal, torch.tensor([Q]), 0.3).num_accepted.tolist() == [2]
    assert verifier_only_gate(proposal, torch.tensor([Q]), 0.05).num_accepted.tolist() == [4]
    assert verifier_only_gate(proposal, torch.tensor([Q]), 0.95).num_accepted.tolist() == [1]


def test_proposer_only_gate_mars_rule():
    proposal = _proposal([DRAFT], [P_TILDE], [4])
    assert proposer_only_gate(proposal, 0.45).num_accepted.tolist() == [2]
    assert proposer_only_gate(proposal, 0.95).output_token_ids.tolist() == [[11, PH, PH, PH, PH]]
    assert proposer_only_gate(proposal, 0.4).num_accepted.tolist() == [4]


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_gate_threshold_out_of_range_raises(bad):
    proposal = _proposal([DRAFT], [P_TILDE], [4])
    with pytest.raises(ValueError, match="theta"):
        product_gate(proposal, torch.tensor([Q]), bad)
    with pytest.raises(ValueError, match="tau"):
        proposer_only_gate(proposal, bad)


def test_lossless_greedy_cases():
    draft = torch.tensor([[11, 12, 13, 14], [11, 12, 13, 14], [11, 12, 13, 14], [11, 12, PH, PH]])
    target = torch.tensor([
        [11, 12, 99, 14, 15],  # first mismatch at j = 3: recovered g_3 = 99
        [11, 12, 13, 14, 15],  # all match: bonus g_5 = 15
        [98, 12, 13, 14, 15],  # first token fails: only the recovered g_1
        [11, 12, 77, 88, 15],  # n = 2, both match: bonus is g_3 = 77, not g_5
    ])
    verdict = lossless_greedy(draft, torch.tensor([4, 4, 4, 2]), target)
    assert verdict.num_accepted.tolist() == [2, 4, 0, 2]
    assert verdict.num_emitted.tolist() == [3, 5, 1, 3]
    assert verdict.output_token_ids.tolist() == [
        [11, 12, 99, PH, PH],
        [11, 12, 13, 14, 15],
        [98, PH, PH, PH, PH],
        [11, 12, 77, PH, PH],
    ]


def test_lossless_greedy_single_draft_token():
    verdict = lossless_greedy(torch.tensor([[5, PH]]), torch.tensor([1]), torch.tensor([[5, 6, 7]]))
    assert verdict.output_token_ids.tolist() == [[5, 6, PH]]
    verdict = lossless_greedy(torch.tensor([[5, PH]]), torch.tensor([1]), torch.tensor([[4, 6, 7]]))
    assert verdict.output_token_ids.tolist() == [[4, PH, PH]]


def _sdd_logits() -> torch.Tensor:
    """[1, 4, 4]: logits for draft [1, 2, 3] plus the bonus position.

    pos 0: draft 1 is the argmax (gap 0)
    pos 1: draft 2 has gap -0.5 (argmax 3)
    pos 2: draft 3 has gap -1.0, third largest (argmax 0, second 1)
    pos 3: bonus argmax 3
    """
    return torch.tensor([[
        [0.0, 3.0, 0.0, 0.0],
        [0.0, 0.0, 2.5, 3.0],
        [5.0, 4.5, 0.0, 4.0],
        [0.0, 0.0, 0.0, 9.0],
    ]])


DRAFT_SDD = torch.tensor([[1, 2, 3]])
N_SDD = torch.tensor([3])


def test_strict_greedy_over_logits():
    verdict = strict_greedy(DRAFT_SDD, N_SDD, _sdd_logits())
    assert verdict.output_token_ids.tolist() == [[1, 3, PH, PH]]
    assert verdict.num_accepted.tolist() == [1]


@pytest.mark.parametrize(
    ("lenience", "expected"),
    [
        (1.0, [1, 3, PH, PH]),  # strict
        (0.7, [1, 3, PH, PH]),  # log .7 = -.36: gap -.5 fails at pos 1 -> argmax 3
        (0.5, [1, 2, 0, PH]),  # log .5 = -.69: pos 1 passes, pos 2 (gap -1) fails -> argmax 0
        (0.3, [1, 2, 3, 3]),  # log .3 = -1.2: all pass -> bonus 3
    ],
)
def test_lenient_accept(lenience, expected):
    verdict = lenient_accept(DRAFT_SDD, N_SDD, _sdd_logits(), lenience)
    assert verdict.output_token_ids.tolist() == [expected]


def test_lenient_one_breaks_ties_like_strict():
    # draft 1 ties the max with token 0; argmax picks 0, so l = 1 must reject like strict SDD.
    logits = torch.tensor([[[3.0, 3.0], [0.0, 1.0]]])
    verdict = lenient_accept(torch.tensor([[1]]), torch.tensor([1]), logits, 1.0)
    assert verdict.output_token_ids.tolist() == [[0, PH]]
    verdict = lenient_accept(torch.tensor([[1]]), torch.tensor([1]), logits, 0.999)
    assert verdict.output_token_ids.tolist() == [[1, 1]]


@pytest.mark.parametrize(
    ("k", "expected"),
    [(1, [1, 3, PH, PH]), (2, [1, 2, 0, PH]), (3, [1, 2, 3, 3])],
)
def test_topk_accept(k, expected):
    verdict = topk_accept(DRAFT_SDD, N_SDD, _sdd_logits(), k)
    assert verdict.output_token_ids.tolist() == [expected]


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.01])
def test_lenience_out_of_range_raises(bad):
    with pytest.raises(ValueError, match="lenience"):
        lenient_accept(DRAFT_SDD, N_SDD, _sdd_logits(), bad)


@pytest.mark.parametrize("bad", [0, 5])
def test_topk_out_of_range_raises(bad):
    with pytest.raises(ValueError, match="k must"):
        topk_accept(DRAFT_SDD, N_SDD, _sdd_logits(), bad)


def test_gate_registry_and_apply_gate():
    proposal = _proposal([DRAFT], [P_TILDE], [4])
    q = torch.tensor([Q])
    assert set(GATES) == set(GateKind)
    assert torch.equal(apply_gate(GateKind.PRODUCT, proposal, q, 0.01).output_token_ids,
                       product_gate(proposal, q, 0.01).output_token_ids)
    assert apply_gate("product", proposal, q, 0.3).num_accepted.tolist() == [2]
    assert apply_gate("verifier", proposal, q, 0.05).num_accepted.tolist() == [4]
    assert apply_gate("proposer", proposal, None, 0.45).num_accepted.tolist() == [2]
    assert not GateKind.PROPOSER.needs_verifier and GateKind.PRODUCT.needs_verifier
    with pytest.raises(ValueError, match="needs verifier_probs"):
        apply_gate("product", proposal, None, 0.3)
    with pytest.raises(ValueError):
        apply_gate("logistic", proposal, q, 0.3)
