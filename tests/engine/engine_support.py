"""Shared pieces of the engine tests: environment, engine lifetimes, request cases, oracles.

Engines are expensive (~20 s and ~2 GB each on the CPU) and the machine is shared, so at
most one is alive at a time: each test module starts its engine in a module fixture, runs
every scenario it needs, and shuts it down (``engine``). Comparisons use vLLM's own greedy
decoding (lossless) or the transformers reference decoders (gated modes) as oracles; a
divergence is accepted only at a proven near-tie (``explain_divergence``).
"""

from __future__ import annotations

import contextlib
import json
import socket
from dataclasses import dataclass, field
from pathlib import Path

# Before vLLM is imported anywhere in the session (the worker processes inherit it): the
# project's own CPU default, the one `vllm-prove generate / bench / serve` set for users.
from vllm_prove.engine.generate import prepare_environment  # noqa: E402

prepare_environment()

import torch  # noqa: E402

ZOO = Path(__file__).resolve().parents[2] / "vllm_prove" / "zoo" / "models"
PROPOSER = str(ZOO / "proposer")
VERIFIER = str(ZOO / "verifier")
DRAFTER = str(ZOO / "drafter")
BLOCK_SIZE = 8  # B: the zoo's proposer was trained with B = 8
THETA = 0.1  # the verifier-mode threshold
TAU = 0.3  # MARS: the zoo proposer's mask confidences rarely reach 0.95; 0.3 commits blocks
NEAR_TIE = 1e-4  # a divergence is tolerated only below this logit gap / gate margin
IN_FLIGHT = 16

# One engine configuration for every mode, chosen to exercise vLLM's hard paths at once:
# chunked prefill (budget 128 < the longest prompts), prefix caching (32-token KV blocks,
# prompts sharing long prefixes) and KV pressure (16 blocks: 16 requests in flight preempt,
# a single one never does).
ENGINE_KWARGS = dict(
    model=PROPOSER, dtype="float32", enforce_eager=True, seed=0, max_model_len=384, block_size=32,
    max_num_seqs=IN_FLIGHT, max_num_batched_tokens=128, enable_chunked_prefill=True,
    enable_prefix_caching=True, num_gpu_blocks_override=16, disable_log_stats=False,
)
# Per-request spec-decode metrics (vLLM refuses the flag without speculative decoding).
PER_REQUEST_METRICS = dict(per_request_spec_decode_metrics="summary")


def prove_config(mode: str, **overrides) -> dict:
    """``additional_config`` for a mode with the test's settings."""
    settings = {"mode": mode, "block_size": BLOCK_SIZE}
    settings |= {"verifier": {"verifier": VERIFIER, "theta": THETA}, "mars": {"tau": TAU}}.get(mode, {})
    return {"prove": settings | overrides}


def prove_engine_kwargs(mode: str, **overrides) -> dict:
    """Engine kwargs of a ProVe mode: only ``additional_config`` (the plugin does the rest)."""
    return {"additional_config": prove_config(mode, **overrides)} | PER_REQUEST_METRICS


@contextlib.contextmanager
def engine(**kwargs):
    """A vLLM engine with ``ENGINE_KWARGS`` updated by ``kwargs``, shut down on exit."""
    from vllm_prove.engine.generate import engine as started_engine

    with started_engine(ENGINE_KWARGS | kwargs) as llm:
        yield llm


def free_port() -> int:
    """A TCP port free on the loopback now (for a server a test starts)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def heldout_prompts() -> list[str]:
    return [json.loads(line)["prompt"] for line in (ZOO / "heldout_prompts.jsonl").read_text().splitlines()]


@dataclass(frozen=True)
class Case:
    """One request: a prompt and the limits that end it."""

    prompt: str
    max_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    def sampling_params(self, **kwargs):
        from vllm import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, stop=list(self.stop) or None,
                              stop_token_ids=list(self.stop_token_ids) or None, **kwargs)


# A frequent token ("\n" in the zoo tokenizer) used as an extra stop token: it stops
# requests in the middle of a committed block, like an EOS would.
NEWLINE_TOKEN_ID = 200
# Prompts of a single token in the zoo tokenizer.
ONE_TOKEN_PROMPTS = ["def", "class", "import"]


def build_cases(with_stop_strings: bool = True) -> list[Case]:
    """The 64 held-out prompts plus long (chunked), shared-prefix and one-token ones, mixed limits.

    Every 5th request stops at ``NEWLINE_TOKEN_ID`` (an EOS inside a block), every 7th at a
    stop string (lossless only: the reference decoders know no stop strings). One-token
    prompts reach the scheduler with a single uncomputed token (ProveScheduler's reserve, or
    vLLM's padding of new requests to 1 + K tokens).
    """
    prompts = heldout_prompts()
    shared = prompts[60] + prompts[61]  # > 64 tokens: two full 32-token KV blocks to share
    prompts = (prompts + ["".join(prompts[i:i + 4]) for i in (0, 20)] + [shared + p for p in prompts[:4]]
               + ONE_TOKEN_PROMPTS)
    cases = []
    for i, prompt in enumerate(prompts):
        stop_ids = (NEWLINE_TOKEN_ID,) if i % 5 == 4 else ()
        stop = ("):", " = ") if with_stop_strings and i % 7 == 3 else ()
        cases.append(Case(prompt, max_tokens=8 + (i * 11) % 33, stop=stop, stop_token_ids=stop_ids))
    return cases


def seeded_subset(cases: list[Case]) -> list[Case]:
    """Every 4th case plus every prompt longer than the 128-token chunk budget (chunked prefill)."""
    return [c for i, c in enumerate(cases) if i % 4 == 0 or len(c.prompt) > 400]


def generate(llm, cases: list[Case], in_flight: int) -> list:
    """``RequestOutput`` per case: all at once (``in_flight`` > 1) or one after another."""
    params = [case.sampling_params() for case in cases]
    prompts = [case.prompt for case in cases]
    if in_flight == 1:
        return [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    return llm.generate(prompts, params, use_tqdm=False)


def seeded_runs(llm, cases: list[Case], temperature: float = 0.8) -> dict[str, list[list[int]]]:
    """Seeded sampled requests (seed = case index), one after another and all at once: under
    chunked prefill their samples during a prompt's prefill are discarded (cpu_fixes)."""
    params = [case.sampling_params().clone() for case in cases]
    for i, sp in enumerate(params):
        sp.temperature, sp.seed = temperature, 1000 + i
    prompts = [case.prompt for case in cases]
    alone = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    together = llm.generate(prompts, params, use_tqdm=False)
    return {"alone": token_ids(alone), "together": token_ids(together)}


def seeded_at_the_budget_edge(llm, cases, tokenizer) -> dict:
    """A seeded sampling request 8th in line behind 7 greedy ones, all decoding at once. Each
    drafting request takes its 1 + K tokens and its drafting slots of the 128-token step
    (lossless, K = 8: 9 + 8; sdd, gamma = 16: 17 + 1), so vLLM itself would give the 8th one
    token without drafts at every step, and its seed would draw other numbers than alone
    (vllm_prove.engine.seeded). Then 8 seeded requests at once: the 8th waits for a whole step.
    Short prompts and outputs: two KV blocks per request, so the 16-block cache preempts none."""
    from vllm import SamplingParams, TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=tokenizer(c.prompt, add_special_tokens=False)["input_ids"][:6])
               for c in cases[:8]]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)
    seeds = [seeded.clone() for _ in prompts]
    for i, params in enumerate(seeds):
        params.seed = i
    alone = token_ids(llm.generate([prompts[7]], seeded, use_tqdm=False))
    all_alone = token_ids([llm.generate([p], params, use_tqdm=False)[0] for p, params in zip(prompts, seeds)])
    before = engine_metric(llm, "vllm:num_preemptions")
    together = token_ids(llm.generate(prompts, [greedy] * 7 + [seeded], use_tqdm=False)[7:])
    all_together = token_ids(llm.generate(prompts, seeds, use_tqdm=False))
    return {"alone": alone[0], "together": together[0], "all_alone": all_alone, "all_together": all_together,
            "preemptions": engine_metric(llm, "vllm:num_preemptions") - before}


def assert_seeded_edge_invariant(edge: dict) -> None:
    """``seeded_at_the_budget_edge``'s seeded texts equal the same requests alone."""
    assert edge["preemptions"] == 0  # the premise: nothing preempted, only the budget is tight
    assert len(edge["alone"]) == 10 and all(len(t) == 10 for t in edge["all_alone"])
    assert edge["together"] == edge["alone"]
    assert edge["all_together"] == edge["all_alone"]


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def engine_metric(llm, name: str) -> float:
    """A counter / gauge of the engine's Prometheus registry (``LLM.get_metrics``)."""
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


def truncate(tokens: list[int], case: Case, eos_token_id: int) -> list[int]:
    """The reference runner's output rules for ``case``: stop at (and keep) EOS or a stop id."""
    stop_ids = {eos_token_id, *case.stop_token_ids}
    out = []
    for token in tokens[: case.max_tokens]:
        out.append(token)
        if token in stop_ids:
            break
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First index where the sequences differ (a length difference counts); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclass
class Divergence:
    case_index: int
    position: int
    near_tie: bool
    detail: str = ""
    extra: dict = field(default_factory=dict)


def top2_gap(model, context: list[int], num_masks: int = 0, mask_token_id: int = 1) -> list[float]:
    """fp32 top-2 logit gaps of ``model`` at the last context position and each mask after it."""
    ids = torch.tensor([context + [mask_token_id] * num_masks])
    with torch.no_grad():
        logits = model(ids).logits[0, len(context) - 1:].float()  # [1 + num_masks, vocab]
    top2 = logits.topk(2, dim=-1).values  # [1 + num_masks, 2]
    return (top2[:, 0] - top2[:, 1]).tolist()


def greedy_continuation(model, context: list[int], num_tokens: int) -> list[int]:
    """``model``'s fp32 greedy continuation of ``context``, ``num_tokens`` tokens."""
    ids, out, past = torch.tensor([context]), [], None
    with torch.no_grad():
        for _ in range(num_tokens):
            result = model(ids, past_key_values=past, use_cache=True)
            past, token = result.past_key_values, int(result.logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return out


def abort_mid_generation(llm, cases: list[Case], num_requests: int = 8, num_steps: int = 6) -> dict:
    """Start requests, abort them after a few steps, and report whether KV blocks leaked.

    ``LLM.reset_prefix_cache`` succeeds only when every KV block except the null block is
    free (``vllm/v1/core/block_pool.py:837``): after the aborts nothing else runs, so a
    failure means the aborted requests kept blocks.
    """
    from vllm import SamplingParams

    engine_ = llm.llm_engine
    request_ids = [f"abort-{i}" for i in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for request_id, case in zip(request_ids, cases):
        engine_.add_request(request_id, case.prompt, params)
    partial = {}
    for _ in range(num_steps):
        for output in engine_.step():
            partial[output.request_id] = len(output.outputs[0].token_ids)
    engine_.abort_request(request_ids)
    while engine_.has_unfinished_requests():
        engine_.step()
    return {"tokens_before_abort": partial, "all_blocks_free": llm.reset_prefix_cache()}


def exact_joint(model, prompt_ids: list[int], num_tokens: int, temperature: float, top_k: int) -> dict[tuple, float]:
    """The proposer's exact distribution of its next ``num_tokens`` tokens (top-k sampling)."""
    joint = {(): 1.0}
    for _ in range(num_tokens):
        prefixes = list(joint)
        ids = torch.tensor([prompt_ids + list(prefix) for prefix in prefixes])  # [prefixes, len]
        with torch.no_grad():
            logits = model(ids).logits[:, -1].float() / temperature  # [prefixes, vocab]
        top = logits.topk(top_k, dim=-1)
        probs = torch.softmax(top.values, dim=-1)  # [prefixes, top_k]
        joint = {prefix + (int(token),): joint[prefix] * float(prob)
                 for prefix, tokens, row in zip(prefixes, top.indices, probs) for token, prob in zip(tokens, row)}
    return joint


def total_variation(samples: list[tuple], joint: dict[tuple, float]) -> float:
    """TV distance between the empirical distribution of ``samples`` and ``joint``."""
    counts: dict[tuple, int] = {}
    for sample in samples:
        counts[sample] = counts.get(sample, 0) + 1
    support = set(joint) | set(counts)
    return 0.5 * sum(abs(counts.get(x, 0) / len(samples) - joint.get(x, 0.0)) for x in support)


def tv_null_quantile(joint: dict[tuple, float], num_samples: int, quantile: float, repeats: int = 2000,
                     seed: int = 0) -> float:
    """``quantile`` of the TV of ``num_samples`` exact draws from ``joint`` (seeded simulation)."""
    probs = torch.tensor(list(joint.values()), dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    draws = torch.multinomial(probs.expand(repeats, -1), num_samples, replacement=True, generator=gen)
    counts = torch.zeros(repeats, len(probs), dtype=torch.float64).scatter_add_(1, draws, torch.ones_like(draws, dtype=torch.float64))
    tvs = 0.5 * (counts / num_samples - probs).abs().sum(dim=1)  # [repeats]
    return float(torch.quantile(tvs, quantile))


def explain_greedy_divergence(proposer, prompt_ids: list[int], got: list[int], expected: list[int]) -> Divergence | None:
    """None if equal; else whether the first divergent token is a genuine argmax near-tie."""
    position = first_divergence(got, expected)
    if position is None:
        return None
    if position >= min(len(got), len(expected)):
        return Divergence(-1, position, False, f"same tokens, different lengths {len(got)} vs {len(expected)}")
    gap = top2_gap(proposer, prompt_ids + expected[:position])[0]
    return Divergence(-1, position, gap < NEAR_TIE, f"top-2 logit gap {gap:.3g} at token {position}")


def assert_equal_or_near_tie(got_runs, expected, cases, proposer, tokenizer):
    """Every request's tokens equal plain greedy's, or first differ at a genuine argmax near-tie."""
    failures, ties = [], []
    for case_index, (case, got, want) in enumerate(zip(cases, got_runs, expected)):
        prompt_ids = tokenizer(case.prompt, add_special_tokens=False)["input_ids"]
        divergence = explain_greedy_divergence(proposer, prompt_ids, got, want)
        if divergence is None:
            continue
        (ties if divergence.near_tie else failures).append((case_index, divergence.detail))
    if ties:
        print(f"accepted as genuine near-ties (top-2 logit gap < 1e-4): {ties}")
    assert not failures, f"{len(failures)} requests diverge from plain greedy decoding: {failures}"


def explain_gated_divergence(models, prompt_ids: list[int], got: list[int], expected: list[int], records,
                             threshold: float) -> Divergence | None:
    """None if equal; else whether the reference's cycle holding the first divergent token had a
    gate score within NEAR_TIE of the threshold or a window argmax near-tie."""
    position = first_divergence(got, expected)
    if position is None:
        return None
    if position >= min(len(got), len(expected)):
        return Divergence(-1, position, False, f"same tokens, different lengths {len(got)} vs {len(expected)}")
    start = 0
    for record in records:  # find the reference cycle that committed token `position`
        if start + record.committed > position:
            break
        start += record.committed
    else:
        return Divergence(-1, position, False, "past the reference's cycles")
    offset = position - start  # the divergent token's place in the reference's block
    scores = [p * q for p, q in zip(record.proposer_probs, record.verifier_probs)] or record.proposer_probs
    # the gate decisions that could have ended the engine's block before or at the divergent token
    margin = min((abs(s - threshold) for s in scores[1 : offset + 1]), default=float("inf"))
    gap = top2_gap(models.proposer, prompt_ids + expected[:start], BLOCK_SIZE - 1, models.mask_token_id)[offset]
    tie = margin < NEAR_TIE or gap < NEAR_TIE
    return Divergence(-1, position, tie, f"cycle at token {start}, divergent offset {offset}: gate margin "
                      f"{margin:.3g} (positions 2..{offset + 1}), window top-2 gap {gap:.3g} at it")
