"""Tensor parallelism on the CPU backend: two workers, one core each, the model sharded in two.

The lossless drafter runs through the sharded served model and the verifier is sharded like
the proposer (docs/design/multi_gpu.md), so at TP = 2: lossless == vLLM's plain greedy at
TP = 2, and verifier mode == the transformers reference decoder, token for token (fp32).
"""

from __future__ import annotations

import os

import pytest
from engine_support import BLOCK_SIZE, THETA, VERIFIER, explain_gated_divergence, explain_greedy_divergence, heldout_prompts

from vllm_prove.config import DecodeConfig, Method
from vllm_prove.engine.generate import drive, engine

pytestmark = [pytest.mark.slow, pytest.mark.engine]

TP = 2
MAX_TOKENS = 24
NUM_PROMPTS = 12


@pytest.fixture(scope="module")
def tp_outputs():
    """Greedy tokens of AR, lossless and verifier mode at TP = 2 (one engine at a time)."""
    from vllm import SamplingParams

    # vLLM's CPU auto-binding wants one NUMA node per worker; this machine has one: one core each.
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in sorted(os.sched_getaffinity(0))[:TP])
    prompts = heldout_prompts()[:NUM_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    modes = {"ar": {}, "lossless": {"mode": "lossless", "block_size": BLOCK_SIZE},
             "verifier": {"mode": "verifier", "verifier": VERIFIER, "theta": THETA, "block_size": BLOCK_SIZE}}
    out = {}
    try:
        for name, prove in modes.items():
            kwargs = dict(model=str(VERIFIER).replace("verifier", "proposer"), dtype="float32", enforce_eager=True,
                          seed=0, max_num_seqs=4, max_model_len=512, tensor_parallel_size=TP,
                          distributed_executor_backend="mp")
            if prove:
                kwargs["additional_config"] = {"prove": prove}
            with engine(kwargs) as llm:
                out[name + "_probe"] = llm.collective_rpc("prove_probe") if prove else None
                results, _ = drive(llm, prompts, params, 4)
                out[name] = [r.token_ids for r in results]
    finally:
        if saved is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved
    return prompts, out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < TP, reason="needs two cores, one per worker")
def test_lossless_at_tp2_equals_plain_greedy_at_tp2(tp_outputs, zoo_models):
    prompts, out = tp_outputs
    assert [len(p) for p in out["lossless_probe"]] == [len(out["lossless_probe"][0])] * TP  # one probe per rank
    assert all(p["drafter_shares_model"] for p in out["lossless_probe"])
    failures = []
    for index, (prompt, got, expected) in enumerate(zip(prompts, out["lossless"], out["ar"])):
        prompt_ids = zoo_models.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        divergence = explain_greedy_divergence(zoo_models.proposer, prompt_ids, got, expected)
        if divergence is not None and not divergence.near_tie:
            failures.append((index, divergence.position))
    assert not failures, f"lossless at TP={TP} diverges from plain greedy at TP={TP}: {failures}"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < TP, reason="needs two cores, one per worker")
def test_verifier_mode_at_tp2_equals_the_reference_decoder(tp_outputs, zoo_models):
    from vllm_prove.reference.runner import generate as reference_generate

    prompts, out = tp_outputs
    assert all(p["gated"] and not p["drafter_shares_model"] for p in out["verifier_probe"])
    cfg = DecodeConfig(method=Method.PROVE, theta=THETA, block_size=BLOCK_SIZE, batch_size=1, max_tokens=MAX_TOKENS)
    reference, _ = reference_generate(cfg, prompts, zoo_models)
    failures = []
    for index, (prompt, got, ref) in enumerate(zip(prompts, out["verifier"], reference)):
        prompt_ids = zoo_models.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        divergence = explain_gated_divergence(zoo_models, prompt_ids, got, ref.token_ids, ref.records, THETA)
        if divergence is not None and not divergence.near_tie:
            failures.append((index, divergence.position, divergence.detail))
    assert not failures, f"verifier mode at TP={TP} diverges from the reference: {failures}"
