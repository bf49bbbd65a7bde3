"""The gated modes inside vLLM (verifier: the product gate at theta = 0.1; MARS: the tau rule)
against the transformers reference decoders (``vllm_prove.reference``), token for token.

One engine per mode, with the stress settings of ``ENGINE_KWARGS`` (chunked prefill, prefix
caching, KV pressure that preempts at 16 in flight). The reference runs at batch size 1 with
the same block size and threshold; its output for a request is its greedy run cut by the
request's limits (``truncate``: decoding is causal, so limits never change earlier tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from engine_support import (
    BLOCK_SIZE,
    IN_FLIGHT,
    TAU,
    THETA,
    abort_mid_generation,
    build_cases,
    engine,
    engine_metric,
    explain_gated_divergence,
    generate,
    prove_engine_kwargs,
    token_ids,
    truncate,
)

from vllm_prove.config import DecodeConfig, Method
from vllm_prove.engine import metrics

pytestmark = [pytest.mark.slow, pytest.mark.engine]

MODES = {"verifier": (Method.PROVE, THETA), "mars": (Method.MARS, TAU)}


@dataclass
class GatedRun:
    mode: str
    reference: list = field(default_factory=list)  # reference RequestResult per case (untruncated)
    reference_summary: dict = field(default_factory=dict)
    greedy: dict[int, list[list[int]]] = field(default_factory=dict)
    preemptions: float = 0.0
    summary: metrics.SpecDecodeSummary | None = None
    per_request: list = field(default_factory=list)
    probe: dict = field(default_factory=dict)
    abort: dict = field(default_factory=dict)
    mixed: dict = field(default_factory=dict)  # the fallback path beside the gate, one batch


GATED_KV_BLOCKS = 13


@pytest.fixture(scope="module")
def cases():
    return build_cases(with_stop_strings=False)


def _run_mode(mode: str, cases, zoo_models) -> GatedRun:
    from vllm_prove.reference.runner import generate as reference_generate

    method, threshold = MODES[mode]
    run = GatedRun(mode)
    cfg = DecodeConfig(method=method, theta=THETA, tau=TAU, block_size=BLOCK_SIZE, batch_size=1,
                       max_tokens=max(c.max_tokens for c in cases))
    run.reference, run.reference_summary = reference_generate(cfg, [c.prompt for c in cases], zoo_models)
    # 13 KV blocks (max_model_len 384 plus the window look-ahead): any request fits alone, 16 in flight preempt even
    # when the gate commits whole blocks and requests finish fast (the self-distilled zoo)
    with engine(**prove_engine_kwargs(mode), num_gpu_blocks_override=GATED_KV_BLOCKS) as llm:
        run.probe = llm.collective_rpc("prove_probe")[0]
        run.greedy[1] = token_ids(generate(llm, cases, 1))
        run.abort = abort_mid_generation(llm, cases)
        before = engine_metric(llm, "vllm:num_preemptions")
        outputs = generate(llm, cases, IN_FLIGHT)
        run.preemptions = engine_metric(llm, "vllm:num_preemptions") - before
        run.greedy[IN_FLIGHT] = token_ids(outputs)
        run.per_request = [metrics.from_request(o.outputs[0].spec_decode_metrics) for o in outputs]
        run.summary = metrics.from_engine_metrics(llm.get_metrics())
        run.mixed = _mixed_batch(llm, cases)
    return run


def _mixed_batch(llm, cases) -> dict:
    """Greedy requests (the gate) in one batch with requests the gate cannot serve: sampled
    (temperature 0.8, seeded), and greedy with logprobs (vLLM's sampler, no window)."""
    chosen = cases[:24]
    params = []
    for i, case in enumerate(chosen):
        if i % 3 == 0:
            params.append(case.sampling_params())  # gate
        elif i % 3 == 1:
            params.append(case.sampling_params().clone())
            params[-1].temperature, params[-1].seed = 0.8, i  # fallback: sampled
        else:
            params.append(case.sampling_params().clone())
            params[-1].logprobs = 1  # fallback: greedy with logprobs
    outputs = llm.generate([c.prompt for c in chosen], params, use_tqdm=False)
    return {"kinds": [("gate", "sampled", "logprobs")[i % 3] for i in range(len(chosen))],
            "tokens": token_ids(outputs), "logprobs": [o.outputs[0].logprobs for o in outputs],
            "drafts": [metrics.from_request(o.outputs[0].spec_decode_metrics).num_drafts for o in outputs]}


@pytest.fixture(scope="module")
def verifier_run(cases, zoo_models) -> GatedRun:
    return _run_mode("verifier", cases, zoo_models)


@pytest.fixture(scope="module")
def mars_run(cases, zoo_models, verifier_run) -> GatedRun:  # after verifier_run: one engine at a time
    return _run_mode("mars", cases, zoo_models)


@pytest.fixture(params=list(MODES))
def run(request) -> GatedRun:
    return request.getfixturevalue(f"{request.param}_run")


@pytest.mark.parametrize("in_flight", [1, IN_FLIGHT])
def test_gated_mode_equals_the_reference_decoder(run, cases, zoo_models, in_flight):
    threshold = MODES[run.mode][1]
    failures, ties = [], []
    eos = zoo_models.tokenizer.eos_token_id
    for index, (case, got, ref) in enumerate(zip(cases, run.greedy[in_flight], run.reference)):
        expected = truncate(ref.token_ids, case, eos)
        prompt_ids = zoo_models.tokenizer(case.prompt, add_special_tokens=False)["input_ids"]
        divergence = explain_gated_divergence(zoo_models, prompt_ids, got, expected, ref.records, threshold)
        if divergence is not None:
            (ties if divergence.near_tie else failures).append((index, divergence.position, divergence.detail))
    if ties:
        print(f"{run.mode}: accepted as genuine near-ties (within 1e-4): {ties}")
    assert not failures, f"{run.mode}: {len(failures)} requests diverge from the reference: {failures}"


def test_gated_scenarios_exercise_the_hard_paths(run, cases):
    assert run.preemptions > 0
    outputs = run.greedy[IN_FLIGHT]
    assert any(len(o) < c.max_tokens and o[-1] in c.stop_token_ids for o, c in zip(outputs, cases))
    assert max(run.reference_summary["committed_histogram"]) >= 3  # the gate commits whole blocks


def test_gated_engine_layout(run):
    probe = run.probe
    assert probe["gated"]
    if run.mode == "mars":  # no second model: the drafter slot shares the served model
        assert probe["drafter_shares_model"]
        assert all(name.startswith("model.layers.") for name in probe["kv_layers"])
    else:  # the verifier is vLLM's draft model, with its own KV layers in the same cache
        assert not probe["drafter_shares_model"]
        assert any(name.startswith("draft_model.") for name in probe["kv_layers"])


def test_gated_abort_frees_every_kv_block(run):
    assert any(n > 0 for n in run.abort["tokens_before_abort"].values())
    assert run.abort["all_blocks_free"]


def test_gated_mode_serves_what_the_gate_cannot_beside_it(run, cases, zoo_models):
    """on_unsupported = "fallback" (the default): in one batch, greedy requests go through the
    gate (same tokens as the gate alone, windows used) while sampled and logprobs requests are
    decoded by vLLM's sampler without windows: greedy-with-logprobs equals plain greedy AR and
    carries the logprob of each emitted token."""
    from vllm_prove.config import DecodeConfig, Method
    from vllm_prove.reference.runner import generate as reference_generate

    mixed = run.mixed
    index = {k: [i for i, kind in enumerate(mixed["kinds"]) if kind == k] for k in ("gate", "sampled", "logprobs")}
    for i in index["gate"]:
        assert mixed["tokens"][i] == run.greedy[IN_FLIGHT][i]
        assert mixed["logprobs"][i] is None
    assert sum(mixed["drafts"][i] for i in index["gate"]) > 0
    for i in index["sampled"] + index["logprobs"]:
        assert mixed["drafts"][i] == 0  # no window: the fallback path
        assert 0 < len(mixed["tokens"][i]) <= cases[i].max_tokens
    ar_cfg = DecodeConfig(method=Method.AR, max_tokens=max(cases[i].max_tokens for i in index["logprobs"]))
    ar, _ = reference_generate(ar_cfg, [cases[i].prompt for i in index["logprobs"]], zoo_models)
    for i, reference in zip(index["logprobs"], ar):
        got = mixed["tokens"][i]
        assert got == truncate(reference.token_ids, cases[i], zoo_models.tokenizer.eos_token_id)
        assert len(mixed["logprobs"][i]) == len(got)
        for token, top in zip(got, mixed["logprobs"][i]):
            assert token in top and top[token].logprob <= 0.0


def test_gated_metrics_count_committed_tokens_per_cycle(run, cases):
    summary = run.summary
    num_masks = BLOCK_SIZE - 1
    assert summary.num_drafts > 0
    assert summary.num_draft_tokens <= num_masks * summary.num_drafts  # B - 1 masks per window
    assert summary.num_accepted_tokens == sum(summary.accepted_per_position)
    assert all(a >= b for a, b in zip(summary.accepted_per_position, summary.accepted_per_position[1:]))
    # Per request: vLLM's histogram of accepted drafts is the gate's a - 1 per window, so the
    # tokens a request committed through windows never exceed its output.
    for per_request, output in zip(run.per_request, run.greedy[IN_FLIGHT]):
        committed = per_request.num_drafts + per_request.num_accepted_tokens
        assert committed >= len(output) - 1 and per_request.num_drafts <= len(output) + BLOCK_SIZE
