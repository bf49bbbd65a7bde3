"""Speculative diffusion decoding inside vLLM (mode ``sdd``): strict SDD is vLLM's greedy AR
token for token; the lossy rules and verifier skipping decide like the transformers reference.

Engines one after the other, all with ``ENGINE_KWARGS`` (chunked prefill, prefix caching, KV
pressure that preempts at 16 in flight): vLLM without speculation (the oracle), strict SDD
(per-step acceptance recorded: ``per_request_spec_decode_metrics="detailed"``), verifier skipping
with permissive thresholds (many skips, a small S_max), lenience and top-k. The reference
decoders run in this process on the same prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from engine_support import (
    DRAFTER,
    IN_FLIGHT,
    abort_mid_generation,
    assert_seeded_edge_invariant,
    build_cases,
    engine,
    engine_metric,
    first_divergence,
    generate,
    seeded_at_the_budget_edge,
    token_ids,
    truncate,
)

from vllm_prove.config import DecodeConfig, Method

pytestmark = [pytest.mark.slow, pytest.mark.engine]

GAMMA, STEPS = 16, 2  # the zoo drafter's training setting
SKIP = {"k_min": 2, "s_max": 6, "eta_b": 0.5, "eta_c": 0.6}  # permissive: skips in most requests
RULES = {"lenience": ("sdd-lenience", {"lenience": 0.5}), "topk": ("sdd-topk", {"top_k": 2})}
NUM_REFERENCE = 16  # prompts compared with the reference decoders (one in flight)
EOS_TOKEN_ID = 0  # the zoo tokenizer's <|endoftext|>
MASK_TOKEN_ID = 1


def sdd_config(rule: str, **extra) -> dict:
    return {"additional_config": {"prove": {"mode": "sdd", "drafter": DRAFTER, "block_size": GAMMA,
                                            "steps": STEPS, "rule": rule, **extra}}}


@dataclass
class Run:
    greedy: dict[int, list[list[int]]] = field(default_factory=dict)  # in flight -> token ids
    preemptions: dict[int, float] = field(default_factory=dict)
    per_step: list[list[int]] = field(default_factory=list)  # one in flight: accepted drafts per step
    counters: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)


def _greedy_runs(llm, cases, run: Run) -> None:
    for n in (IN_FLIGHT, 1):
        before = engine_metric(llm, "vllm:num_preemptions")
        outputs = generate(llm, cases, n)
        run.greedy[n] = token_ids(outputs)
        run.preemptions[n] = engine_metric(llm, "vllm:num_preemptions") - before
        if n == 1:
            run.per_step = [list(o.outputs[0].spec_decode_metrics.per_step_accepted) for o in outputs]


@pytest.fixture(scope="module")
def cases():
    return build_cases(with_stop_strings=False)  # the reference decoders know no stop strings


@pytest.fixture(scope="module")
def ar(plain_vllm):
    """vLLM's plain greedy decoding of ``cases`` (the session's one plain engine)."""
    return {n: plain_vllm["greedy"]["bare", n] for n in (IN_FLIGHT, 1)}


@pytest.fixture(scope="module")
def strict(cases, zoo_models):
    run = Run()
    with engine(**sdd_config("strict"), per_request_spec_decode_metrics="detailed") as llm:
        _greedy_runs(llm, cases, run)
        run.counters = llm.collective_rpc("prove_sdd_counters")[0]
        run.extra["abort"] = abort_mid_generation(llm, cases)
        run.extra["drafted"] = engine_metric(llm, "vllm:spec_decode_num_draft_tokens")
        run.extra["accepted"] = engine_metric(llm, "vllm:spec_decode_num_accepted_tokens")
        run.extra["edge"] = seeded_at_the_budget_edge(llm, cases, zoo_models.tokenizer)  # last: sampled requests
    return run


@pytest.fixture(scope="module")
def skip(cases):
    run = Run()
    with engine(**sdd_config("skip", **SKIP), per_request_spec_decode_metrics="detailed") as llm:
        _greedy_runs(llm, cases, run)
        run.counters = llm.collective_rpc("prove_sdd_counters")[0]
        run.extra["drafted"] = engine_metric(llm, "vllm:spec_decode_num_draft_tokens")
        run.extra["accepted"] = engine_metric(llm, "vllm:spec_decode_num_accepted_tokens")
        run.extra["abort"] = abort_mid_generation(llm, cases)
    return run


@pytest.fixture(scope="module", params=sorted(RULES))
def relaxed(request, cases):
    run = Run()
    method, setting = RULES[request.param]
    with engine(**sdd_config(request.param, **setting)) as llm:
        run.greedy[1] = token_ids(generate(llm, cases[:NUM_REFERENCE], 1))
        run.counters = llm.collective_rpc("prove_sdd_counters")[0]
    return method, setting, run


@pytest.fixture(scope="module")
def sdd_reference():
    from vllm_prove.reference.runner import load_models

    models = load_models(DecodeConfig(method=Method.SDD))

    def decode(case, method: str, **setting):
        from vllm_prove.reference.runner import generate as reference_generate

        cfg = DecodeConfig(method=Method(method), gamma=GAMMA, steps=STEPS, max_tokens=case.max_tokens, **setting)
        results, _ = reference_generate(cfg, [case.prompt], models, eos_token_id=_eos(case))
        return truncate(results[0].token_ids, case, EOS_TOKEN_ID), results[0].records

    return decode


def _eos(case) -> int:
    return case.stop_token_ids[0] if case.stop_token_ids else EOS_TOKEN_ID


def _mismatches(a: list[list[int]], b: list[list[int]]) -> list[tuple[int, int]]:
    return [(i, first_divergence(x, y)) for i, (x, y) in enumerate(zip(a, b)) if x != y]


# -- strict SDD: greedy AR exactly -----------------------------------------------------------

@pytest.mark.parametrize("in_flight", [1, IN_FLIGHT])
def test_strict_sdd_equals_vllm_greedy_ar(strict, ar, in_flight):
    assert _mismatches(strict.greedy[in_flight], ar[in_flight]) == []


def test_strict_sdd_preempts_at_sixteen_in_flight_and_still_matches(strict):
    assert strict.preemptions[IN_FLIGHT] > 0 and strict.preemptions[1] == 0


def test_strict_sdd_drafts_and_commits_several_tokens_per_target_pass(strict):
    tokens = sum(len(t) for t in strict.greedy[1]) + sum(len(t) for t in strict.greedy[IN_FLIGHT])
    assert strict.counters["verifier_calls"] * 2 < tokens  # > 2 tokens per target pass on average
    assert strict.counters["skipped_rounds"] == 0
    assert 0 < strict.extra["accepted"] < strict.extra["drafted"]


def test_vllm_drafts_are_the_reference_drafters(strict, cases, sdd_reference):
    """The same accepted drafts in every round (one in flight): vLLM's KV-cached block drafter
    drafts what the transformers drafter drafts. The reference's first round is the prompt's pass,
    vLLM's prefill step (no drafts)."""
    for i, case in enumerate(cases[:NUM_REFERENCE]):
        tokens, records = sdd_reference(case, "sdd")
        assert strict.greedy[1][i] == tokens, i
        # every round but the last (a request's limit may cut its last block differently)
        steps = strict.per_step[i][:-1]
        assert [a + 1 for a in steps] == [r.committed for r in records[1:]][: len(steps)], i


def test_seeded_request_at_the_budget_edge_is_scheduled_whole(strict):
    """Strict SDD samples through vLLM's rejection sampler: a seeded request that vLLM would cut
    to one token without drafts (8th of a 128-token step at gamma = 16) is scheduled whole, and
    its text alone and in the batch is the same (vllm_prove.engine.seeded)."""
    assert_seeded_edge_invariant(strict.extra["edge"])


def test_aborts_free_every_kv_block(strict):
    abort = strict.extra["abort"]
    assert abort["all_blocks_free"] and any(n > 0 for n in abort["tokens_before_abort"].values())


# -- verifier skipping -------------------------------------------------------------------------

def test_skip_mode_equals_the_reference_at_one_in_flight(skip, cases, sdd_reference):
    for i, case in enumerate(cases[:NUM_REFERENCE]):
        tokens, _ = sdd_reference(case, "sdd-skip", **SKIP)
        assert skip.greedy[1][i] == tokens, (i, first_divergence(skip.greedy[1][i], tokens))


def test_skip_mode_is_batch_invariant_with_preemption(skip):
    assert skip.preemptions[IN_FLIGHT] > 0
    assert _mismatches(skip.greedy[IN_FLIGHT], skip.greedy[1]) == []


def test_skips_commit_without_the_target_within_s_max(skip, cases):
    counters = skip.counters
    assert counters["skipped_rounds"] > 0 and counters["verifier_calls"] < counters["draft_blocks"]
    assert counters["skipped_tokens"] == sum(k for _, _, k in counters["skips"])
    # one chain of skips (contiguous segments of a request) stays within S_max + gamma - 1
    chains: dict[tuple[str, int], int] = {}
    ends: dict[str, tuple[int, int]] = {}
    for request, start, k in counters["skips"]:
        key = ends.get(request)
        chain = key if key is not None and key[1] == start else (start, start)
        chains[(request, chain[0])] = chains.get((request, chain[0]), 0) + k
        ends[request] = (chain[0], start + k)
        assert k >= SKIP["k_min"]
    assert max(chains.values()) <= SKIP["s_max"] + GAMMA - 1
    # no skipped token is special (EOS, the mask) and no request ends past its limit
    outputs = {str(i): t for i, t in enumerate(skip.greedy[1])}
    for request, start, k in counters["skips"]:
        if request in outputs:
            assert not {EOS_TOKEN_ID, MASK_TOKEN_ID} & set(outputs[request][start:start + k])
    assert all(len(t) <= c.max_tokens for t, c in zip(skip.greedy[IN_FLIGHT], cases))


def test_skipped_tokens_are_not_counted_as_accepted_drafts(skip, cases, sdd_reference):
    """vLLM's acceptance counters count verified drafts only (the skipped tokens are committed
    outside verification): per step, the accepted drafts are the reference's verified rounds'."""
    assert 0 < skip.extra["accepted"] <= skip.extra["drafted"]
    some_skipped = False
    for i, case in enumerate(cases[:NUM_REFERENCE]):
        _, records = sdd_reference(case, "sdd-skip", **SKIP)
        verified = [r.committed - 1 for r in records[1:] if r.verified]
        some_skipped |= any(not r.verified for r in records)
        steps = skip.per_step[i][:-1]  # the last step may be cut by the request's limit
        assert steps == verified[: len(steps)], i
    assert some_skipped


def test_skip_aborts_free_every_kv_block(skip):
    abort = skip.extra["abort"]
    assert abort["all_blocks_free"] and any(n > 0 for n in abort["tokens_before_abort"].values())


# -- lenience and top-k ------------------------------------------------------------------------

def test_relaxed_rules_equal_the_reference_at_one_in_flight(relaxed, cases, sdd_reference):
    method, setting, run = relaxed
    for i, case in enumerate(cases[:NUM_REFERENCE]):
        tokens, _ = sdd_reference(case, method, **setting)
        assert run.greedy[1][i] == tokens, (method, i, first_divergence(run.greedy[1][i], tokens))
    assert "strict_token" in run.counters and run.counters["strict_token"] < 1.0  # they did relax
