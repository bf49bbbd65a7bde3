"""Run a reference decoder over a prompt list with `batch_size` requests in flight.

Continuous batching: a finished request's row is handed to the next prompt at once. The runner
owns the output rules: tokens after EOS (EOS itself is emitted, as vLLM does) and past
`max_tokens` are never emitted, even when the decoder committed them in one block.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_prove.config import DecodeConfig, Method
from vllm_prove.core.metrics import CycleStats, auc
from vllm_prove.reference.decoders import DECODERS, CycleRecord
from vllm_prove.errors import ProveError
from vllm_prove.paths import zoo_path


@dataclass
class RequestResult:
    index: int
    prompt: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    cycles: int = 0
    seconds: float = 0.0
    records: list[CycleRecord] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"index": self.index, "prompt": self.prompt, "token_ids": self.token_ids, "text": self.text,
                "num_tokens": len(self.token_ids), "cycles": self.cycles, "seconds": round(self.seconds, 4)}


@dataclass
class Models:
    tokenizer: object
    proposer: object  # the AR target of the SDD methods
    verifier: object | None
    mask_token_id: int
    drafter: object | None = None  # diffusion drafter (SDD methods)
    drafter_mask_id: int = -1
    drafter_spec: dict = field(default_factory=dict)  # config.json `diffusion_drafter`: kind, logits_shift


def load_models(cfg: DecodeConfig) -> Models:
    """Load the proposer (and the verifier when the method needs one) in `cfg.dtype`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, cfg.dtype)
    proposer_path = cfg.proposer or zoo_path("proposer")
    tok = AutoTokenizer.from_pretrained(proposer_path)
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=dtype, attn_implementation="sdpa").eval()  # noqa: E731
    proposer = load(proposer_path)
    if cfg.method.diffusion:
        return attach_drafter(cfg, Models(tok, proposer, None, -1), load)
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else getattr(proposer.config, "mask_token_id", None)
    needs_mask = cfg.method not in (Method.AR, Method.SD)
    if needs_mask and mask_id is None:
        raise ProveError(f"mask_token_id: the proposer at {proposer_path} has no `mask_token_id` in config.json "
                         "and none was given; method %r needs one" % cfg.method.value)
    verifier = None
    if cfg.method in (Method.SD, Method.PROVE):
        verifier = load(cfg.verifier or zoo_path("verifier"))
        if verifier.config.vocab_size != proposer.config.vocab_size:
            raise ProveError(f"verifier: vocabulary size {verifier.config.vocab_size} != proposer's "
                             f"{proposer.config.vocab_size}; proposer and verifier must share a tokenizer")
    return Models(tok, proposer, verifier, mask_id if mask_id is not None else -1)


def attach_drafter(cfg: DecodeConfig, models: Models, load=None) -> Models:
    """Load the diffusion drafter (MDLM/BERT or Dream style, docs/METHODS.md §7) and check it
    against the target: one vocabulary, one mask id."""
    from transformers import AutoModelForCausalLM

    from vllm_prove.reference.drafter import resolve_drafter

    path = cfg.drafter or zoo_path("drafter")
    mask_id, spec = resolve_drafter(path, models.tokenizer, cfg.mask_token_id)
    load = load or (lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=getattr(torch, cfg.dtype),
                                                                    attn_implementation="sdpa").eval())
    models.drafter, models.drafter_mask_id, models.drafter_spec = load(path), mask_id, spec
    return models


def generate(cfg: DecodeConfig, prompts: list[str], models: Models | None = None, *,
             track_ar_match: bool = False, eos_token_id: int | None = None,
             features: bool = False) -> tuple[list[RequestResult], dict]:
    """Decode every prompt; return per-request results and the run summary.

    `eos_token_id` overrides the tokenizer's stop token (tests use it to stop mid-block).
    `features` (SDD methods): keep each round's survival-predictor features in its record."""
    models = models or load_models(cfg)
    tok = models.tokenizer
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise ProveError(f"prompt {i} is empty: nothing to condition on")
    if cfg.method.diffusion:
        from vllm_prove.reference.sdd import build_sdd_decoder

        dec = build_sdd_decoder(cfg, models, features=features)
    else:
        dec = DECODERS[cfg.method](cfg, models.proposer, models.verifier, mask_token_id=models.mask_token_id,
                                   pad_id=tok.eos_token_id, track_ar_match=track_ar_match)
    eos = tok.eos_token_id if eos_token_id is None else eos_token_id
    results = [RequestResult(i, p, prompt_token_ids=ids) for i, (p, ids) in enumerate(zip(prompts, prompt_ids))]
    queue, rows = deque(range(len(prompts))), [None] * cfg.batch_size
    started: dict[int, float] = {}
    t0 = time.perf_counter()
    while True:
        for r in range(cfg.batch_size):
            if rows[r] is None and queue:
                rows[r] = queue.popleft()
                dec.admit(r, prompt_ids[rows[r]])
                started[rows[r]] = time.perf_counter()
        active = [i is not None for i in rows]
        if not any(active):
            break
        committed, records = dec.cycle(active)
        for r, i in enumerate(rows):
            if i is None:
                continue
            res = results[i]
            res.cycles += 1
            res.records.append(records[r])
            done = False
            for token in committed[r]:
                res.token_ids.append(token)
                if token == eos or len(res.token_ids) >= cfg.max_tokens:
                    done = True
                    break
            if done:
                res.seconds = time.perf_counter() - started[i]
                res.text = tok.decode(res.token_ids, skip_special_tokens=True)
                rows[r] = None
    seconds = time.perf_counter() - t0 - getattr(dec, "untimed_seconds", 0.0)  # minus shadow audits
    return results, summarize(cfg, results, seconds, dec)


def summarize(cfg: DecodeConfig, results: list[RequestResult], seconds: float, dec) -> dict:
    stats = CycleStats(total_seconds=seconds)
    stats.record_counts([rec.committed for res in results for rec in res.records] or [0])
    s = stats.summary()
    num_tokens = sum(len(r.token_ids) for r in results)
    out = {"method": cfg.method.value, "engine": "reference", "num_tokens": num_tokens,
           "seconds": round(seconds, 4), "tokens_per_s": round(num_tokens / seconds, 2) if seconds > 0 else 0.0,
           "cycles": s["cycles"], "committed_per_cycle": round(s["mean_committed_per_cycle"], 4),
           "committed_histogram": s["histogram"], "batch_size": cfg.batch_size, "block_size": cfg.block_size,
           "passes": {name: {"passes": kv.passes, "rows": kv.rows} for name, kv in dec.models().items()}}
    if cfg.method in (Method.PROVE, Method.PROVE_LOSSLESS, Method.MARS):
        out.update(block_diagnostics(results, cfg.block_size, lossy=cfg.method is not Method.PROVE_LOSSLESS))
    if cfg.method.diffusion:
        from vllm_prove.reference.sdd import sdd_summary

        del out["block_size"]  # a ProVe setting; the SDD block is gamma
        out["passes"]["drafter"] = {"passes": dec.drafter.passes}
        out |= {"gamma": cfg.gamma, "steps": cfg.steps} | sdd_summary(
            [rec for res in results for rec in res.records], num_tokens)
    settings = ("theta", "tau", "k", "lenience", "top_k", "k_min", "s_max", "eta_b", "eta_c")
    return out | {k: getattr(cfg, k) for k in settings if _uses(cfg.method, k)} | (
        {"gate": cfg.gate.value} if cfg.method == Method.PROVE else {}) | (
        {"signal": cfg.signal.value} if cfg.method == Method.SDD_SKIP else {})


def _uses(method: Method, name: str) -> bool:
    return {"theta": method == Method.PROVE, "tau": method == Method.MARS, "k": method == Method.SD,
            "lenience": method == Method.SDD_LENIENCE, "top_k": method == Method.SDD_TOPK,
            "k_min": method == Method.SDD_SKIP, "s_max": method == Method.SDD_SKIP,
            "eta_b": method == Method.SDD_SKIP, "eta_c": method == Method.SDD_SKIP}[name]


def block_diagnostics(results: list[RequestResult], block_size: int, lossy: bool = True) -> dict:
    """AR-matching prefix, per-position match rate, and AUC of p~, q, p~*q (ProVe Figure 4).

    `off_ar_share` (lossy methods): share of committed tokens past the block's AR-matching
    prefix, i.e. tokens where the output leaves the greedy AR path (docs/METHODS.md §8).

    The AUC population is the one a sequential gate sees: positions 2..B whose earlier
    positions all matched greedy AR; the label is whether the position matches too.
    """
    recs = [rec for res in results for rec in res.records if rec.ar_match is not None]
    if not recs:
        return {}
    out: dict = {"ar_matching_prefix": round(sum(r.ar_match for r in recs) / len(recs), 4)}
    if lossy:
        off = sum(max(0, r.committed - r.ar_match) for r in recs)
        out["off_ar_share"] = round(off / max(1, sum(r.committed for r in recs)), 4)
    per_pos = [0] * block_size
    for r in recs:  # share of blocks whose AR-matching prefix reaches position i
        for i in range(min(r.ar_match, block_size)):
            per_pos[i] += 1
    out["prefix_match_rate_per_position"] = [round(c / len(recs), 4) for c in per_pos]
    labels, scores = [], {"p": [], "q": [], "pq": []}
    for r in recs:
        for i in range(1, min(r.ar_match + 1, block_size)):
            labels.append(int(i < r.ar_match))
            scores["p"].append(r.proposer_probs[i])
            if r.verifier_probs:
                scores["q"].append(r.verifier_probs[i])
                scores["pq"].append(r.proposer_probs[i] * r.verifier_probs[i])
    for name, vals in scores.items():
        if vals and 0 < sum(labels) < len(labels):
            out[f"auc_{name}"] = round(auc(torch.tensor(vals), torch.tensor(labels)), 4)
    return out


def write_outputs(results: list[RequestResult], summary: dict, out: str | Path, summary_path: str | Path | None):
    import json
    for path in (out, summary_path):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("".join(json.dumps(r.to_json()) + "\n" for r in results))
    if summary_path:
        Path(summary_path).write_text(json.dumps(summary, indent=2) + "\n")
