"""Side-by-side benchmark of the reference decoders on the zoo (one process, one run).

Every configuration runs on the same held-out prompts right after the others, so ratios are
comparable (absolute times on these noisy machines are not, across runs). Columns:
tokens/s and its ratio to AR, committed tokens per cycle, AR-matching prefix of the proposed
blocks, the share of committed tokens that leave the greedy AR path (docs/METHODS.md §8), and the
cost model's ideal speedup from pass costs measured in the same process.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from vllm_prove.config import DecodeConfig, Method
from vllm_prove.core.cost_model import (LOSSLESS_CYCLE_COST, ideal_speedup, prove_cycle_cost,
                                        rho_from_pass_times, sd_cycle_cost)
from vllm_prove.reference.kv import BatchedKV
from vllm_prove.reference.runner import generate, load_models

DEFAULT_RUNS = [  # (label, DecodeConfig overrides)
    ("ar", {"method": Method.AR}),
    ("sd k=3", {"method": Method.SD, "k": 3}),
    ("sd k=5", {"method": Method.SD, "k": 5}),
    ("mars tau=0.95", {"method": Method.MARS, "tau": 0.95}),
    ("prove theta=0.1", {"method": Method.PROVE, "theta": 0.1}),
    ("prove theta=0.05", {"method": Method.PROVE, "theta": 0.05}),
    ("prove theta=0.01", {"method": Method.PROVE, "theta": 0.01}),
    ("prove-lossless", {"method": Method.PROVE_LOSSLESS}),
]


@torch.no_grad()
def pass_seconds(model, context_len: int, num_tokens: int, rows: int = 1, repeats: int = 10) -> float:
    """Median seconds of one cached pass reading `num_tokens` per row after `context_len` tokens."""
    kv = BatchedKV(model, rows)
    kv.extend(torch.full((rows, context_len), 7), torch.full((rows,), context_len))
    kv.commit(torch.full((rows,), context_len))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        kv.extend(torch.full((rows, num_tokens), 7), torch.full((rows,), num_tokens))
        times.append(time.perf_counter() - t)
        kv.discard()
    return sorted(times)[len(times) // 2]


def pass_costs(proposer, verifier, block: int, rows: int = 1, ks=(3, 5), context_len: int = 64) -> dict:
    """Seconds of every pass a method's cycle is made of, `rows` requests at a time:
    AR step, window (B tokens), verify (B + 1), verifier over the block and over one token
    (an SD draft step; None without a verifier), SD verify (k + 1)."""
    run = lambda model, n: None if model is None else pass_seconds(model, context_len, n, rows)  # noqa: E731
    return {"rows": rows, "ar": run(proposer, 1), "window": run(proposer, block), "verify": run(proposer, block + 1),
            "verifier_block": run(verifier, block), "verifier": run(verifier, 1),
            "verify_sd": {k: run(proposer, k + 1) for k in ks}}


def cycle_cost(method: Method, k: int, costs: dict) -> float:
    """Cycle cost in AR-pass units from measured pass times (docs/METHODS.md §6): the paper's
    `1 + rho`, `1 + k * rho`, `2` with each proposer pass at its measured width."""
    ar = costs["ar"]
    if method is Method.AR:
        return 1.0
    if method is Method.MARS:
        return costs["window"] / ar
    if method is Method.PROVE:
        return prove_cycle_cost(rho_from_pass_times(costs["verifier_block"], ar)) - 1 + costs["window"] / ar
    if method is Method.PROVE_LOSSLESS:
        return LOSSLESS_CYCLE_COST - 2 + (costs["window"] + costs["verify"]) / ar
    return sd_cycle_cost(k, rho_from_pass_times(costs["verifier"], ar)) - 1 + costs["verify_sd"][k] / ar


def run_bench(prompts: list[str], *, max_tokens: int = 64, batch_sizes=(1,), runs=DEFAULT_RUNS,
              out_dir: str | Path | None = None) -> list[dict]:
    models = load_models(DecodeConfig(method=Method.PROVE))
    block = DecodeConfig().block_size
    costs = pass_costs(models.proposer, models.verifier, block)
    rows = []
    for bs in batch_sizes:
        ar_tokens, ar_tps = None, None
        for label, overrides in runs:
            cfg = DecodeConfig(max_tokens=max_tokens, batch_size=bs, **overrides)
            diag = cfg.method in (Method.MARS, Method.PROVE)
            # lossless gets its AR-matching prefix for free (its verify pass is the greedy reference)
            results, summary = generate(cfg, prompts, models, track_ar_match=cfg.method is Method.PROVE_LOSSLESS)
            if diag:  # the AR-match diagnostic costs a pass: measured apart from the timed run
                _, d = generate(cfg, prompts, models, track_ar_match=True)
                summary |= {k: v for k, v in d.items() if k.startswith(("ar_", "auc_", "prefix_", "off_ar"))}
            tokens = [r.token_ids for r in results]
            if cfg.method is Method.AR:
                ar_tokens, ar_tps = tokens, summary["tokens_per_s"]
            row = {"label": label, "batch_size": bs, **summary,
                   "ratio_to_ar": round(summary["tokens_per_s"] / ar_tps, 3) if ar_tps else None,
                   "identical_to_ar": sum(a == b for a, b in zip(tokens, ar_tokens)) / len(tokens) if ar_tokens else None,
                   "ideal_speedup": round(ideal_speedup(summary["committed_per_cycle"],
                                                        cycle_cost(cfg.method, cfg.k, costs)), 3)}
            rows.append(row)
            print(format_row(row), flush=True)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps({"pass_seconds": costs, "rows": rows}, indent=2) + "\n")
    return rows


HEADER = (f"{'method':<18}{'bs':>3}{'tok/s':>9}{'x AR':>7}{'commit/cyc':>11}{'AR-prefix':>10}"
          f"{'off-AR':>8}{'=AR':>6}{'ideal':>7}{'auc p~':>8}{'auc q':>7}{'auc pq':>8}")


def format_cell(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-".rjust(int(spec.split(".")[0]))


def format_row(row: dict) -> str:
    return (f"{row['label']:<18}{row['batch_size']:>3}{format_cell(row['tokens_per_s'], '9.1f')}"
            f"{format_cell(row['ratio_to_ar'], '7.2f')}{format_cell(row['committed_per_cycle'], '11.2f')}"
            f"{format_cell(row.get('ar_matching_prefix'), '10.2f')}{format_cell(row.get('off_ar_share'), '8.3f')}"
            f"{format_cell(row['identical_to_ar'], '6.2f')}{format_cell(row['ideal_speedup'], '7.2f')}"
            f"{format_cell(row.get('auc_p'), '8.3f')}{format_cell(row.get('auc_q'), '7.3f')}{format_cell(row.get('auc_pq'), '8.3f')}")
