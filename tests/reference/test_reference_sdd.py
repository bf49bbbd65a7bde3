"""Speculative diffusion decoding, reference decoders (docs/METHODS.md §7): the zoo's proposer is
the AR target, the zoo's block-diffusion drafter drafts."""

from __future__ import annotations

import json

import pytest
import torch

from test_reference_exactness import assert_matches_oracle
from vllm_prove.config import DecodeConfig, Method
from vllm_prove.reference.runner import generate
from vllm_prove.reference.sdd import NOT_AUDITED, write_traces

NUM_PROMPTS = 24  # a share of the held-out prompts keeps the lossy-mode tests quick


@pytest.mark.parametrize("batch_size", [1, 16])
def test_strict_sdd_equals_greedy_ar(sdd_models, heldout_prompts, ar_oracle, oracle_max_tokens, batch_size):
    cfg = DecodeConfig(method=Method.SDD, batch_size=batch_size, max_tokens=oracle_max_tokens)
    results, summary = generate(cfg, heldout_prompts, sdd_models)
    assert_matches_oracle(results, ar_oracle, heldout_prompts, sdd_models, f"sdd bs={batch_size}")
    assert summary["committed_per_cycle"] > 2.0  # the drafter drafts: more than one token per target pass
    # every round verifies; each request's first round reads its prompt with no draft (the prefill)
    assert summary["verifier_calls"] == summary["cycles"] == summary["draft_blocks"] + len(heldout_prompts)


@pytest.mark.parametrize("method,setting", [(Method.SDD_LENIENCE, {"lenience": 1.0}), (Method.SDD_TOPK, {"top_k": 1})])
def test_relaxed_rules_at_their_strict_end_are_strict_sdd(sdd_models, heldout_prompts, ar_oracle, oracle_max_tokens,
                                                          method, setting):
    cfg = DecodeConfig(method=method, batch_size=8, max_tokens=oracle_max_tokens, **setting)
    results, _ = generate(cfg, heldout_prompts, sdd_models)
    assert_matches_oracle(results, ar_oracle, heldout_prompts, sdd_models, method.value)


@pytest.fixture(scope="module")
def skip_run(sdd_models, heldout_prompts):
    """Verifier skipping with permissive gates (many skips) and a small S_max, traces on."""
    cfg = DecodeConfig(method=Method.SDD_SKIP, batch_size=8, max_tokens=48, k_min=2, s_max=6, eta_b=0.5, eta_c=0.6)
    return cfg, *generate(cfg, heldout_prompts[:NUM_PROMPTS], sdd_models, features=True)


def test_skip_commits_without_the_target_and_s_max_holds(skip_run, sdd_models):
    cfg, results, summary = skip_run
    assert summary["skipped_rounds"] > 0 and summary["verifier_calls"] < summary["draft_blocks"]
    special = set(sdd_models.tokenizer.all_special_ids) | {sdd_models.drafter_mask_id}
    for res in results:
        unverified = 0
        for rec in res.records:
            if rec.verified:
                unverified = 0
                continue
            assert rec.committed == rec.K_hat >= cfg.k_min  # a skip commits exactly x_1..x_K^
            assert not special & set(rec.proposed[: rec.K_hat])  # never a special token unverified
            assert unverified < cfg.s_max  # a skip happens only below S_max ...
            unverified += rec.committed
            assert unverified <= cfg.s_max + cfg.gamma - 1  # ... so D never passes S_max + gamma - 1
        assert all(rec.strict != NOT_AUDITED for rec in res.records)  # every round audited (shadow on)
    assert 0.0 <= summary["strict_token"] <= 1.0 and 0.0 <= summary["full_prefix"] <= 1.0


def test_forced_rounds_follow_s_max(skip_run):
    cfg, results, summary = skip_run
    for res in results:
        unverified = 0
        for rec in res.records:
            assert rec.forced == (unverified >= cfg.s_max)
            unverified = 0 if rec.verified else unverified + rec.committed
    assert summary["forced_strict_rounds"] > 0


def test_shadow_audit_changes_nothing(skip_run, sdd_models, heldout_prompts):
    cfg, results, summary = skip_run
    quiet, q_summary = generate(cfg.model_copy(update={"shadow": False}), heldout_prompts[:NUM_PROMPTS], sdd_models)
    assert [r.token_ids for r in quiet] == [r.token_ids for r in results]
    assert q_summary["passes"] == summary["passes"]  # the audit's target passes are not counted
    assert q_summary["verifier_calls"] == summary["verifier_calls"]
    assert "strict_token" not in q_summary  # nothing audited, nothing claimed


def test_skip_is_batch_invariant(skip_run, sdd_models, heldout_prompts):
    cfg, results, _ = skip_run
    alone, _ = generate(cfg.model_copy(update={"batch_size": 1}), heldout_prompts[:NUM_PROMPTS], sdd_models)
    assert [r.token_ids for r in alone] == [r.token_ids for r in results]


def test_traces_and_features(skip_run, tmp_path):
    cfg, results, _ = skip_run
    write_traces(results, tmp_path / "t.jsonl", tmp_path / "f.pt")
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert len(lines) == sum(rec.drafted for r in results for rec in r.records)  # first rounds draft nothing
    assert {"prompt", "round", "verified", "K_hat", "strict", "draft", "confidence", "reveal_steps"} <= set(lines[0])
    feats = torch.load(tmp_path / "f.pt", weights_only=True)
    n = len(lines)
    assert feats["hidden"].shape[:2] == (n, cfg.gamma) and feats["scalars"].shape == (n, cfg.gamma, 19)
    assert feats["accepted"].tolist() == [x["strict"] for x in lines]
    assert feats["prompt_id"].tolist() == [x["prompt"] for x in lines]
