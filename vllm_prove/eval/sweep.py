"""`vllm-prove sweep sdd`: the SDD-skipping paper's grids (appendix A.6), on the reference engine
or inside vLLM (`--engine vllm`: one engine per setting, mode `sdd`).

One process runs, on the same held-out prompts: AR, strict SDD, every lenience / top-k setting,
verifier skipping with each signal over its threshold grid, and the K_min sweep. Learned signals
are trained on strict-SDD traces of *other* prompts (cut from the training corpus), so the
evaluation prompts never trained a predictor. Written: `sweep.json` (every run's summary and
quality proxy), `frontier_calls.png` (quality proxy vs verifier calls per token relative to
strict SDD), `frontier_speed.png` (tokens/s vs StrictToken), and the permutation diagnostic.

Quality proxy: the share of generated tokens inside each request's common prefix with greedy AR
(strict SDD == greedy AR, so strict scores 1.0; a lossy method scores what it kept).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from vllm_prove.config import DecodeConfig, Method, SkipSignal
from vllm_prove.core.metrics import common_prefix_length
from vllm_prove.reference.runner import generate, load_models

RAW_PAIRS = [(b, c) for b in (0.90, 0.95) for c in (0.995, 0.99, 0.98, 0.97, 0.95, 0.93, 0.90)] + [
    (0.80, 0.93), (0.80, 0.85), (0.70, 0.70), (0.60, 0.50)]
GRIDS: dict[str, list[dict]] = {  # SDD-skipping paper, Table 5
    "lenience": [{"method": Method.SDD_LENIENCE, "lenience": x} for x in (0.99, 0.975, 0.95, 0.90, 0.80, 0.70, 0.50,
                                                                          0.30)],
    "topk": [{"method": Method.SDD_TOPK, "top_k": k} for k in (2, 3, 5)],
    "raw": [{"method": Method.SDD_SKIP, "signal": SkipSignal.RAW, "eta_b": b, "eta_c": c} for b, c in RAW_PAIRS],
    "marginal": [{"method": Method.SDD_SKIP, "signal": SkipSignal.MARGINAL, "eta_b": m, "eta_c": m}
                 for m in (0.85, 0.90, 0.93, 0.95, 0.97, 0.98, 0.99)],
    "conditional": [{"method": Method.SDD_SKIP, "signal": SkipSignal.CONDITIONAL, "eta_b": 0.90, "eta_c": c}
                    for c in (0.99, 0.98, 0.97, 0.95, 0.93, 0.90, 0.85, 0.80)],
}
K_MIN_SWEEP = (0, 3, 6, 12, 24)  # raw confidence at (eta_b, eta_c) = (0.90, 0.93)
LEARNED = ("marginal", "conditional")


def quality_proxy(results, ar_outputs: list[list[int]]) -> float:
    """Share of generated tokens that lie in the common prefix with greedy AR."""
    kept = sum(common_prefix_length(r.token_ids, a) for r, a in zip(results, ar_outputs))
    return kept / max(1, sum(len(a) for a in ar_outputs))


def run_sweep(prompts: list[str], train_prompts: list[str], *, out_dir: str | Path, families: list[str],
              base: dict, quick: bool = False, engine: str = "reference") -> dict:
    """Every family's grid (a third of each when `quick`) plus the K_min sweep; see the module doc."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    models = load_models(DecodeConfig(method=Method.SDD, **base))
    if engine == "vllm":  # a fresh engine per setting (mode sdd reads its settings at start-up)
        from vllm_prove.engine.generate import generate as engine_generate

        decode = lambda cfg, ps: engine_generate(cfg, ps)  # noqa: E731
    else:
        decode = lambda cfg, ps: generate(cfg, ps, models)  # noqa: E731
        for method in (Method.AR, Method.SDD):  # speed probe: warm every path before anything is timed (§8)
            decode(DecodeConfig(**{**base, "method": method, "max_tokens": 8}), prompts[:2])
    ar, ar_summary = decode(DecodeConfig(method=Method.AR, **base), prompts)
    ar_outputs = [r.token_ids for r in ar]
    strict, strict_summary = decode(DecodeConfig(method=Method.SDD, **base), prompts)
    report = {"settings": base, "engine": engine, "num_prompts": len(prompts), "ar": ar_summary,
              "strict": strict_summary | {"quality": quality_proxy(strict, ar_outputs)}, "runs": []}
    if any(f in LEARNED for f in families):
        report["survival"] = _train_predictors(train_prompts, models, base, out / "survival")
    runs = [(f, s) for f in families for s in (GRIDS[f][::3] if quick else GRIDS[f])]
    runs += [("k_min", {"method": Method.SDD_SKIP, "k_min": k}) for k in K_MIN_SWEEP]
    for family, setting in tqdm(runs, desc="sdd sweep", mininterval=2.0):
        extra = {"survival": str(out / "survival")} if setting.get("signal") in (SkipSignal.MARGINAL,
                                                                                  SkipSignal.CONDITIONAL) else {}
        res, summary = decode(DecodeConfig(**base, **setting, **extra), prompts)
        rel_calls = summary["verifier_calls_per_token"] / strict_summary["verifier_calls_per_token"]
        report["runs"].append({"family": family, "setting": {k: getattr(v, "value", v) for k, v in setting.items()},
                               "quality": round(quality_proxy(res, ar_outputs), 4),
                               "relative_verifier_calls": round(rel_calls, 4),
                               "speedup_vs_strict": round(summary["tokens_per_s"] / strict_summary["tokens_per_s"], 4),
                               "summary": summary})
    if engine == "reference":  # per-round scores: the reference engine's records
        report["permutation"] = _permutation(strict, base)
    (out / "sweep.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    plot_frontiers(report, out)
    return report


def _train_predictors(train_prompts, models, base, folder: Path) -> dict:
    from vllm_prove.reference.sdd import write_traces
    from vllm_prove.train.survival import train_survival

    res, _ = generate(DecodeConfig(method=Method.SDD, **base), train_prompts, models, features=True)
    folder.mkdir(parents=True, exist_ok=True)
    write_traces(res, folder / "traces.jsonl", folder / "traces.pt")
    out = {}
    for signal in LEARNED:
        rep = train_survival(folder / "traces.pt", signal, folder, progress=False).to_dict()
        out[signal] = {k: rep[k] for k in ("mean_test_bce", "mean_baseline_test_bce", "auroc", "per_position_auroc")}
    return out


def _permutation(strict_results, base: dict) -> dict:
    """Raw-confidence permutation diagnostic on the evaluation prompts' strict-SDD rounds."""
    import torch

    from vllm_prove.core.skip_policy import PrefixGate
    from vllm_prove.core.survival import permutation_diagnostic

    recs = [rec for r in strict_results for rec in r.records if rec.drafted]
    scores = torch.tensor([rec.proposer_probs for rec in recs])  # [rounds, gamma]
    accepted = torch.tensor([rec.strict for rec in recs])
    n = torch.full_like(accepted, scores.shape[1])
    out = {}
    for eta_b, eta_c in ((0.90, 0.93), (0.70, 0.70)):
        d = permutation_diagnostic(scores, accepted, n, eta_b, eta_c, PrefixGate.GEOMETRIC_MEAN, repeats=100)
        out[f"{eta_b}/{eta_c}"] = asdict(d)
    return out


def pareto(points: list[tuple[float, float]], minimize_x: bool) -> list[tuple[float, float]]:
    """The points no other point beats on both axes (y is maximized)."""
    sign = 1 if minimize_x else -1
    best, front = -float("inf"), []
    for x, y in sorted(points, key=lambda p: (sign * p[0], -p[1])):
        if y > best:
            front.append((x, y))
            best = y
    return front


def plot_frontiers(report: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, xkey, ykey, minimize_x, xlabel, ylabel in (
            ("frontier_calls", "relative_verifier_calls", "quality", True,
             "verifier calls per token (relative to strict SDD)", "quality proxy (tokens kept from greedy AR)"),
            ("frontier_speed", "strict_token", "tokens_per_s", False, "StrictToken", f"tokens/s ({report.get('engine', 'reference')} engine)")):
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for family in sorted({r["family"] for r in report["runs"]}):
            pts = [(_value(r, xkey), _value(r, ykey)) for r in report["runs"] if r["family"] == family]
            pts = [p for p in pts if p[0] is not None and p[1] is not None]
            if not pts:
                continue
            front = pareto(pts, minimize_x)
            (line,) = ax.plot(*zip(*front), marker="o", ms=4, label=family)
            ax.scatter(*zip(*pts), alpha=0.25, s=12, color=line.get_color())  # dominated settings, faded
        strict = {"relative_verifier_calls": 1.0, "quality": 1.0, "strict_token": 1.0,
                  "tokens_per_s": report["strict"]["tokens_per_s"]}
        ax.scatter([strict[xkey]], [strict[ykey]], marker="*", s=120, color="black", label="strict SDD", zorder=3)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)


def _value(run: dict, key: str):
    return run[key] if key in run else run["summary"].get(key)
