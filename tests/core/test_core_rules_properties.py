"""Hypothesis properties of the acceptance rules, checked against loop-based references."""

from __future__ import annotations

import math

import torch
from core_strategies import (
    FAST,
    assert_verdict_invariants,
    drafts_and_logits,
    drafts_and_targets,
    probabilities,
    proposals_and_verifier_probs,
)
from hypothesis import given
from hypothesis import strategies as st

from vllm_prove.core import (
    BlockProposal,
    lenient_accept,
    lossless_greedy,
    product_gate,
    proposer_only_gate,
    strict_greedy,
    topk_accept,
    verifier_only_gate,
)

gate_kinds = st.sampled_from(["product", "verifier", "proposer"])


def _gate(kind: str, proposal: BlockProposal, q: torch.Tensor, threshold: float):
    if kind == "product":
        return product_gate(proposal, q, threshold)
    if kind == "verifier":
        return verifier_only_gate(proposal, q, threshold)
    return proposer_only_gate(proposal, threshold)


def _reference_gate_length(scores: list[float], n: int, threshold: float) -> int:
    """docs/METHODS.md §3, literally: a = max{a : s_i >= theta for every 2 <= i <= a}."""
    a = 1
    while a < n and scores[a] >= threshold:
        a += 1
    return a


@FAST
@given(proposals_and_verifier_probs(), probabilities, gate_kinds)
def test_gates_match_the_loop_reference(case, theta, kind):
    proposal, q = case
    verdict = _gate(kind, proposal, q, theta)
    assert_verdict_invariants(verdict)
    scores = {"product": proposal.proposer_probs * q, "verifier": q,
              "proposer": proposal.proposer_probs}[kind]
    theta32 = torch.tensor(theta, dtype=torch.float32).item()  # torch compares in float32
    for row, n in enumerate(proposal.num_draft_tokens.tolist()):
        a = _reference_gate_length(scores[row].tolist(), n, theta32)
        assert verdict.num_accepted[row].item() == a
        committed = verdict.output_token_ids[row, :a].tolist()
        assert committed == proposal.draft_token_ids[row, :a].tolist()
    assert torch.equal(verdict.num_emitted, verdict.num_accepted)  # gates never append a token


@FAST
@given(proposals_and_verifier_probs(), probabilities, probabilities, gate_kinds)
def test_lowering_theta_never_commits_fewer(case, theta_a, theta_b, kind):
    proposal, q = case
    low, high = sorted([theta_a, theta_b])
    at_low = _gate(kind, proposal, q, low).num_accepted
    at_high = _gate(kind, proposal, q, high).num_accepted
    assert bool((at_low >= at_high).all())
    assert bool((at_high >= 1).all())  # at least one token committed


@FAST
@given(proposals_and_verifier_probs(), probabilities)
def test_product_gate_with_perfect_verifier_is_the_proposer_rule(case, theta):
    proposal, _ = case
    ones = torch.ones_like(proposal.proposer_probs)
    by_product = product_gate(proposal, ones, theta)
    by_proposer = proposer_only_gate(proposal, theta)
    assert torch.equal(by_product.output_token_ids, by_proposer.output_token_ids)
    assert torch.equal(by_product.num_accepted, by_proposer.num_accepted)


@FAST
@given(proposals_and_verifier_probs())
def test_batched_gate_equals_row_by_row(case):
    proposal, q = case
    batched = product_gate(proposal, q, 0.25)
    for row in range(proposal.batch_size):
        single = BlockProposal(proposal.draft_token_ids[row:row + 1],
                               proposal.proposer_probs[row:row + 1],
                               proposal.num_draft_tokens[row:row + 1])
        alone = product_gate(single, q[row:row + 1], 0.25)
        assert torch.equal(alone.output_token_ids[0], batched.output_token_ids[row])


@FAST
@given(drafts_and_targets())
def test_lossless_emits_the_target_prefix(case):
    draft, lengths, target = case
    verdict = lossless_greedy(draft, lengths, target)
    assert_verdict_invariants(verdict)
    assert torch.equal(verdict.num_emitted, verdict.num_accepted + 1)  # always one verifier token
    for row, n in enumerate(lengths.tolist()):
        a = verdict.num_accepted[row].item()
        emitted = verdict.output_token_ids[row, : a + 1].tolist()
        assert emitted == target[row, : a + 1].tolist()  # exactly greedy g_1..g_{a+1}
        assert draft[row, :a].tolist() == target[row, :a].tolist()
        assert a == n or draft[row, a].item() != target[row, a].item()  # stopped at a mismatch


@FAST
@given(drafts_and_targets())
def test_perfect_proposal_commits_everything_plus_bonus(case):
    draft, lengths, target = case
    perfect_target = target.clone()
    perfect_target[:, : draft.shape[1]] = draft  # the verifier agrees with every draft token
    bonus = perfect_target.gather(1, lengths[:, None])[:, 0]  # g_{n+1}
    verdict = lossless_greedy(draft, lengths, perfect_target)
    assert torch.equal(verdict.num_accepted, lengths)
    assert torch.equal(verdict.num_emitted, lengths + 1)
    last = verdict.output_token_ids.gather(1, lengths[:, None])[:, 0]
    assert torch.equal(last, bonus)


def _reference_lenient_length(draft, logits, n, lenience) -> int:
    a = 0
    while a < n:
        row = logits[a]
        ok = row[draft[a]].item() - row.max().item() >= math.log(lenience)
        if lenience == 1.0:
            ok = draft[a] == row.argmax().item()
        if not ok:
            break
        a += 1
    return a


@FAST
@given(drafts_and_logits(), st.floats(min_value=0.05, max_value=1.0))
def test_lenient_matches_reference_and_appends_argmax(case, lenience):
    draft, lengths, logits = case
    verdict = lenient_accept(draft, lengths, logits, lenience)
    assert_verdict_invariants(verdict)
    for row, n in enumerate(lengths.tolist()):
        a = _reference_lenient_length(draft[row].tolist(), logits[row], n, lenience)
        assert verdict.num_accepted[row].item() == a
        assert verdict.output_token_ids[row, a].item() == logits[row, a].argmax().item()


@FAST
@given(drafts_and_logits(), st.floats(0.05, 1.0), st.floats(0.05, 1.0))
def test_more_lenience_never_accepts_fewer(case, l_a, l_b):
    draft, lengths, logits = case
    strict_l, loose_l = max(l_a, l_b), min(l_a, l_b)
    strict = lenient_accept(draft, lengths, logits, strict_l).num_accepted
    loose = lenient_accept(draft, lengths, logits, loose_l).num_accepted
    assert bool((loose >= strict).all())


@FAST
@given(drafts_and_logits())
def test_lenience_one_is_strict_sdd(case):
    draft, lengths, logits = case
    a = lenient_accept(draft, lengths, logits, 1.0)
    b = strict_greedy(draft, lengths, logits)
    assert torch.equal(a.output_token_ids, b.output_token_ids)


@FAST
@given(drafts_and_logits(), st.integers(1, 4))
def test_topk_matches_rank_reference_and_is_monotone(case, k):
    draft, lengths, logits = case
    verdict = topk_accept(draft, lengths, logits, k)
    assert_verdict_invariants(verdict)
    for row, n in enumerate(lengths.tolist()):
        a = 0
        while a < n:
            rank = int((logits[row, a] > logits[row, a, draft[row, a]]).sum())  # 0 = largest
            if rank >= k:
                break
            a += 1
        assert verdict.num_accepted[row].item() == a
        assert verdict.output_token_ids[row, a].item() == logits[row, a].argmax().item()
    if k < 4:
        wider = topk_accept(draft, lengths, logits, k + 1).num_accepted
        assert bool((wider >= verdict.num_accepted).all())
    strict = strict_greedy(draft, lengths, logits).num_accepted
    assert bool((verdict.num_accepted >= strict).all())
