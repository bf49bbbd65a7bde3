"""`vllm-prove generate --engine vllm`: the reference engine's contract on vLLM's engine.

One ``DecodeConfig`` becomes vLLM's own flags (``engine_kwargs``), the engine decodes the
prompt file greedily with at most ``batch_size`` requests in flight (``drive``: a finished
request's slot goes to the next prompt at once, as in the reference runner), and the run is
written as the same ``OUT.jsonl`` / ``SUMMARY.json``. A cycle is one engine step that gave a
request tokens, so ``committed_per_cycle`` means the same thing for every method (1 for AR).
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections import deque
from pathlib import Path

from vllm_prove.config import DecodeConfig, Method
from vllm_prove.core.adaptive import summary_delta
from vllm_prove.paths import zoo_path
from vllm_prove.reference.runner import RequestResult
from vllm_prove.errors import ProveError

WARMUP_TOKENS = 64  # one untimed request before a timed run (long enough for the adaptive depth's start-up probe)
# vLLM's CPU backend refuses to start without a KV-cache budget (GiB); GPUs size it themselves.
DEFAULT_CPU_KVCACHE_GIB = "1"


def prepare_environment() -> None:
    """Environment vLLM reads at import (call before the first ``import vllm``)."""
    if not os.path.exists("/dev/nvidia0"):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KVCACHE_GIB)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def method_flags(cfg: DecodeConfig) -> dict:
    """vLLM flags (``speculative_config`` / ``additional_config``) of a method; {} for AR."""
    verifier = cfg.verifier or zoo_path("verifier")
    if cfg.method.diffusion:
        return {"additional_config": {"prove": sdd_settings(cfg)}}
    if cfg.method is Method.AR:
        return {}
    if cfg.method is Method.SD:  # vLLM's own draft-model SD, the verifier as the drafter
        spec = {"speculative_config": {"method": "draft_model", "model": verifier, "num_speculative_tokens": cfg.k}}
        # adaptive: the plug-in's mode "sd" puts vLLM's SD under the adaptive depth; fixed: vLLM alone
        return spec | ({"additional_config": {"prove": {"mode": "sd"}}} if cfg.adaptive else {})
    prove = {"block_size": cfg.block_size}
    if cfg.mask_token_id is not None:
        prove["mask_token_id"] = cfg.mask_token_id
    if cfg.method is Method.MARS:
        prove |= {"mode": "mars", "tau": cfg.tau}
    elif cfg.method is Method.PROVE:
        prove |= {"mode": "verifier", "verifier": verifier, "theta": cfg.theta, "gate": cfg.gate.value}
    else:
        prove |= {"mode": "lossless", "adaptive": cfg.adaptive}
    return {"additional_config": {"prove": prove}}


SDD_RULES = {Method.SDD: "strict", Method.SDD_LENIENCE: "lenience", Method.SDD_TOPK: "topk", Method.SDD_SKIP: "skip"}


def sdd_settings(cfg: DecodeConfig) -> dict:
    """``additional_config["prove"]`` of mode ``sdd`` for a diffusion method (gamma = block_size)."""
    from vllm_prove.config import ProveEngineConfig

    limit = next(m.le for m in ProveEngineConfig.model_fields["block_size"].metadata if hasattr(m, "le"))
    if cfg.gamma > limit:
        raise ProveError(f"gamma: --engine vllm drafts at most {limit} tokens per block (mode 'sdd' block_size), "
                         f"got {cfg.gamma}; the reference engine takes up to 256")
    prove = {"mode": "sdd", "drafter": cfg.drafter or zoo_path("drafter"), "block_size": cfg.gamma,
             "steps": cfg.steps, "rule": SDD_RULES[cfg.method]}
    if cfg.mask_token_id is not None:
        prove["mask_token_id"] = cfg.mask_token_id
    if cfg.method is Method.SDD_LENIENCE:
        prove["lenience"] = cfg.lenience
    if cfg.method is Method.SDD_TOPK:
        prove["top_k"] = cfg.top_k
    if cfg.method is Method.SDD_SKIP:
        prove |= {"signal": cfg.signal.value, "survival": cfg.survival, "k_min": cfg.k_min, "s_max": cfg.s_max,
                  "eta_b": cfg.eta_b, "eta_c": cfg.eta_c}
    return prove


def sdd_counters(llm, reset: bool = False) -> dict | None:
    """Mode ``sdd``'s worker counters (``ProveWorker.prove_sdd_counters``); None in other modes."""
    return llm.collective_rpc("prove_sdd_counters", args=(reset,))[0]


def audit_skips(model, results: list[RequestResult], skips: list[tuple[str, int, int]]) -> tuple[list, list]:
    """The shadow verifier after the run: for each skip ``(request, output index, K)``, ``L`` =
    how many of its tokens greedy verification would have accepted (the target's argmax given
    the committed prefix, one teacher-forced transformers pass per request). Returns (K, L)."""
    import torch

    by_request: dict[str, list[tuple[int, int]]] = {}
    for request_id, start, k in skips:
        by_request.setdefault(request_id, []).append((start, k))
    K, L = [], []
    for res in results:
        segments = by_request.get(str(res.index))
        if not segments:
            continue
        ids = list(res.prompt_token_ids) + list(res.token_ids)
        with torch.no_grad():
            greedy = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()  # greedy[p] predicts ids[p + 1]
        offset = len(res.prompt_token_ids)
        for start, k in segments:
            k = min(k, len(res.token_ids) - start)  # a stop inside the skip ends the request there
            if k <= 0:
                continue
            accepted = 0
            while accepted < k and greedy[offset + start + accepted - 1] == ids[offset + start + accepted]:
                accepted += 1
            K.append(k)
            L.append(accepted)
    return K, L


def sdd_summary(counters: dict, num_tokens: int, audit: tuple[list, list] | None = None) -> dict:
    """SUMMARY.json's SDD fields (the reference engine's names) from the engine's counters."""
    from vllm_prove.core.metrics import full_prefix_acceptance, strict_token_agreement

    out = {"verifier_calls": counters["verifier_calls"], "draft_blocks": counters["draft_blocks"],
           "verifier_calls_per_token": round(counters["verifier_calls"] / max(1, num_tokens), 4),
           "draft_blocks_per_token": round(counters["draft_blocks"] / max(1, num_tokens), 4),
           "skipped_rounds": counters["skipped_rounds"], "skipped_tokens": counters["skipped_tokens"]}
    out |= {k: counters[k] for k in ("strict_token", "full_prefix") if k in counters}
    if audit is not None and audit[0]:
        out |= {"strict_token": round(strict_token_agreement(*audit), 4),
                "full_prefix": round(full_prefix_acceptance(*audit), 4)}
    return out


def parallel_draft_flags(cfg: DecodeConfig) -> dict:
    """vLLM's built-in self parallel drafting: the proposer loaded a second time as its own
    draft (``parallel_drafting``), a second KV cache beside the target's."""
    proposer = cfg.proposer or zoo_path("proposer")
    return {"speculative_config": {"method": "draft_model", "model": proposer, "parallel_drafting": True,
                                   "num_speculative_tokens": cfg.block_size}}


def engine_kwargs(cfg: DecodeConfig, flags: dict, max_num_seqs: int | None = None) -> dict:
    """``LLM(...)`` kwargs: the proposer served eagerly in ``cfg.dtype`` with the method's flags."""
    return {"model": cfg.proposer or zoo_path("proposer"), "dtype": cfg.dtype, "enforce_eager": True, "seed": 0,
            "max_num_seqs": max_num_seqs or cfg.batch_size, "disable_log_stats": False, **flags}


@contextlib.contextmanager
def engine(kwargs: dict):
    """A vLLM ``LLM`` that is shut down (processes and memory released) on exit."""
    prepare_environment()
    from vllm import LLM

    llm = LLM(**kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def adaptive_summary(llm) -> dict | None:
    """``DepthController.summary()`` of an engine running the adaptive depth (from its worker,
    ``ProveWorker.prove_adaptive_summary``); None for an engine without it."""
    from vllm_prove.engine.settings import engine_settings

    settings = engine_settings(llm.llm_engine.vllm_config)
    if settings is None or not settings.adaptive_on:
        return None
    return llm.collective_rpc("prove_adaptive_summary")[0]


def drive(llm, prompts: list[str], params, in_flight: int) -> tuple[list[RequestResult], dict]:
    """Decode ``prompts`` with at most ``in_flight`` requests in the engine at a time.

    Returns one ``RequestResult`` per prompt (``prompt_token_ids`` attached) and the run's
    ``seconds``, ``engine_steps`` and ``adaptive`` (the adaptive depth's decisions during the
    run, ``core.adaptive.summary_delta``; None without it). ``cycles`` of a request = engine
    steps that gave it tokens (its prefill step included).
    """
    if in_flight < 1:
        raise ProveError(f"batch_size: requests in flight must be >= 1, got {in_flight}")
    engine_ = llm.llm_engine
    results = [RequestResult(i, p) for i, p in enumerate(prompts)]
    queue, live, started = deque(range(len(prompts))), set(), {}
    steps = 0
    depth_before = adaptive_summary(llm)
    t0 = time.perf_counter()
    while queue or live:
        while queue and len(live) < in_flight:
            i = queue.popleft()
            started[i] = time.perf_counter()
            engine_.add_request(str(i), prompts[i], params)
            live.add(i)
        outputs = engine_.step()
        steps += 1
        for out in outputs:
            i = int(out.request_id)
            res, completion = results[i], out.outputs[0]
            if len(completion.token_ids) > len(res.token_ids):
                res.cycles += 1
            res.token_ids = list(completion.token_ids)
            if out.finished:
                res.seconds = time.perf_counter() - started[i]
                res.text = completion.text
                res.prompt_token_ids = list(out.prompt_token_ids or [])
                live.discard(i)
    seconds = time.perf_counter() - t0
    depth_after = adaptive_summary(llm)
    depth = None if depth_after is None else summary_delta(depth_before, depth_after)
    return results, {"seconds": seconds, "engine_steps": steps, "adaptive": depth}


def summarize(cfg: DecodeConfig, results: list[RequestResult], run: dict, spec=None) -> dict:
    """The reference runner's summary fields (plus vLLM's spec-decode counters when given)."""
    num_tokens = sum(len(r.token_ids) for r in results)
    cycles = sum(r.cycles for r in results)
    seconds = run["seconds"]
    out = {"method": cfg.method.value, "engine": "vllm", "num_tokens": num_tokens, "seconds": round(seconds, 4),
           "tokens_per_s": round(num_tokens / seconds, 2) if seconds > 0 else 0.0, "cycles": cycles,
           "committed_per_cycle": round(num_tokens / cycles, 4) if cycles else 0.0,
           "batch_size": cfg.batch_size, "dtype": cfg.dtype, "passes": {"engine_steps": run["engine_steps"]}}
    out |= {"gamma": cfg.gamma, "steps": cfg.steps} if cfg.method.diffusion else {"block_size": cfg.block_size}
    out |= {"theta": cfg.theta, "gate": cfg.gate.value} if cfg.method is Method.PROVE else {}
    out |= {"tau": cfg.tau} if cfg.method is Method.MARS else {}
    out |= {"k": cfg.k} if cfg.method is Method.SD else {}
    out |= {"adaptive": cfg.adaptive} if cfg.method in (Method.SD, Method.PROVE_LOSSLESS) else {}
    if run.get("adaptive") is not None:
        out["adaptive_depth"] = run["adaptive"]
    if spec is not None and spec.num_drafts:
        out["spec_decode"] = spec.to_json()
    return out


def generate(cfg: DecodeConfig, prompts: list[str]) -> tuple[list[RequestResult], dict]:
    """Decode ``prompts`` greedily with ``cfg`` on a fresh vLLM engine (the CLI's path), after
    one untimed warm-up request."""
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ProveError(f"prompt {i} is empty: nothing to condition on")
    with engine(engine_kwargs(cfg, method_flags(cfg))) as llm:
        from vllm import SamplingParams

        from vllm_prove.engine import metrics

        # warm-up: the first request of a fresh engine pays one-off costs that are not decoding
        llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS), use_tqdm=False)
        before = metrics.from_engine_metrics(llm.get_metrics())
        diffusion = cfg.method.diffusion and sdd_counters(llm, reset=True) is not None
        results, run = drive(llm, prompts, SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens), cfg.batch_size)
        spec = metrics.from_engine_metrics(llm.get_metrics()) - before
        counters = sdd_counters(llm) if diffusion else None
    summary = summarize(cfg, results, run, spec)
    if counters is not None:
        audit = None
        if counters["skips"]:  # skipped rounds: what strict verification would have accepted
            from transformers import AutoModelForCausalLM

            target = AutoModelForCausalLM.from_pretrained(cfg.proposer or zoo_path("proposer"), dtype="float32").eval()
            audit = audit_skips(target, results, counters["skips"])
        summary |= sdd_summary(counters, summary["num_tokens"], audit)
    return results, summary

