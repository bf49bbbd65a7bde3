"""Side-by-side benchmark inside vLLM's engine (`vllm-prove bench --engine vllm`, `make demo`).

One process, one run: every configuration decodes the same prompts greedily on its own
engine, at each number of requests in flight, right after the others, so the ratios are
comparable (absolute times on these noisy machines are not, across runs). With `--interleave`
the engines are all up at once and take turns run by run, so each ratio compares runs seconds
apart. Rows:

- vLLM AR; vLLM's draft-model SD with the zoo verifier as the drafter (k = 3, 5); vLLM's
  built-in self parallel drafting (the proposer loaded again as its own draft); MARS tau;
  ProVe theta in {0.1, 0.05, 0.01}; ProVe-lossless. Optionally AR and lossless in bf16, and
  `ar control`: a second AR engine, whose ratio to AR (1 in expectation) shows how far this
  machine's noise alone moves a ratio at each concurrency (an A/A test).

Columns: tokens/s and its ratio to AR at the same concurrency, committed tokens per cycle
(engine steps that gave a request tokens), `=AR` (share of tokens inside the common prefix
with vLLM AR's output for the same prompt), `off-argmax` (share of tokens that are not the
fp32 proposer's argmax given the emitted prefix, checked with transformers: the bf16
divergence rate of the paper, and the lossy modes' departure from greedy), peak resident
memory of the engine's processes, KV-cache capacity in tokens, the cost model's ideal speedup
from pass costs measured in this process, and efficiency = measured ratio / ideal.

The pass costs are the models' forward passes (transformers, same rows, same widths); vLLM adds
a per-step overhead (scheduling, input preparation, output processing) that every method pays
once per step, and `ms/step` shows it. On the tiny zoo that overhead is larger than a forward
pass, so methods that commit more tokens per step amortize it better than AR does and the
efficiency can exceed 1; on a large model the passes dominate and it cannot.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_prove.config import DecodeConfig, Method
from vllm_prove.core.cost_model import ideal_speedup
from vllm_prove.core.metrics import common_prefix_length
from vllm_prove.engine import generate as engine_gen
from vllm_prove.errors import ProveError
from vllm_prove.eval.bench import format_cell, cycle_cost, pass_costs


@dataclass(frozen=True)
class EngineRun:
    label: str
    overrides: dict = field(default_factory=dict)  # DecodeConfig fields
    parallel_draft: bool = False  # vLLM's built-in self parallel drafting instead of `method`

    def config(self, **common) -> DecodeConfig:
        return DecodeConfig(**{**common, **self.overrides})

    def flags(self, cfg: DecodeConfig) -> dict:
        return engine_gen.parallel_draft_flags(cfg) if self.parallel_draft else engine_gen.method_flags(cfg)

    def needs(self) -> str | None:
        """The model besides the proposer this row loads: "verifier" (SD's drafter, ProVe's
        verifier), "drafter" (the SDD family's), or None."""
        method = self.config().method
        if method.diffusion:
            return "drafter"
        return "verifier" if method in (Method.SD, Method.PROVE) and not self.parallel_draft else None


FIXED = {"adaptive": False}  # the full depth every step (vLLM's own SD: no plug-in at all)
ENGINE_RUNS = [
    EngineRun("ar", {"method": Method.AR}),
    EngineRun("sd k=3", {"method": Method.SD, "k": 3, **FIXED}),
    EngineRun("sd k=5", {"method": Method.SD, "k": 5, **FIXED}),
    EngineRun("sd k=5 adaptive", {"method": Method.SD, "k": 5}),
    EngineRun("parallel-draft", {"method": Method.PROVE_LOSSLESS}, parallel_draft=True),
    EngineRun("mars tau=0.95", {"method": Method.MARS, "tau": 0.95}),
    EngineRun("prove theta=0.1", {"method": Method.PROVE, "theta": 0.1}),
    EngineRun("prove theta=0.05", {"method": Method.PROVE, "theta": 0.05}),
    EngineRun("prove theta=0.01", {"method": Method.PROVE, "theta": 0.01}),
    EngineRun("prove-lossless", {"method": Method.PROVE_LOSSLESS, **FIXED}),
    EngineRun("prove-lossless adaptive", {"method": Method.PROVE_LOSSLESS}),
    # speculative diffusion decoding: the zoo's diffusion drafter for the proposer as the AR target
    EngineRun("sdd", {"method": Method.SDD}),
    EngineRun("sdd-skip raw", {"method": Method.SDD_SKIP}),
]
# an A/A control, by name only (`--methods "ar control"`): a second engine identical to AR, its
# ratio to AR the resolution of this machine's ratios (no method's ratio means more than its spread)
CONTROL_RUNS = [EngineRun("ar control", {"method": Method.AR})]
BF16_RUNS = [
    EngineRun("ar bf16", {"method": Method.AR, "dtype": "bfloat16"}),
    EngineRun("prove-lossless bf16", {"method": Method.PROVE_LOSSLESS, "dtype": "bfloat16", **FIXED}),
]
PROBE = ("def main():\n", 8)
SWEEP_THETA = 0.1  # the gated row of the block-size sweep


def sweep_runs(block_sizes, default_block_size: int) -> list[EngineRun]:
    """Lossless and ProVe theta = 0.1 at every block size other than the default (the paper's
    Table 4 inside vLLM); the default B is in the main rows already."""
    runs = []
    for b in block_sizes:
        if b != default_block_size:
            runs += [EngineRun(f"prove-lossless B={b}", {"method": Method.PROVE_LOSSLESS, "block_size": b, **FIXED}),
                     EngineRun(f"prove theta={SWEEP_THETA} B={b}",
                               {"method": Method.PROVE, "theta": SWEEP_THETA, "block_size": b})]
    return runs


def select_runs(methods: list[str] | None, block_sizes: list[int] | None = None,
                missing: dict[str, str] | None = None) -> list[EngineRun]:
    """The bench's rows: every row, or those whose label is in `methods` (AR is always first:
    the ratios need it; the A/A control only by name), plus the block-size sweep. `missing`
    names the models a preset lacks (``{"verifier": why}``): rows that need one are left out of
    the default set and refused by name."""
    runs, missing = ENGINE_RUNS, missing or {}
    if methods:
        known = [r.label for r in ENGINE_RUNS + CONTROL_RUNS]
        unknown = [m for m in methods if m not in known]
        if unknown:
            raise ProveError(f"--methods: unknown {unknown}; choose from {known}")
        runs = [r for r in ENGINE_RUNS + CONTROL_RUNS if r.label == "ar" or r.label in methods]
        refused = {r.label: missing[r.needs()] for r in runs if r.needs() in missing}
        if refused:
            raise ProveError(f"--methods: {sorted(refused)} need a model this preset has not: "
                             + "; ".join(sorted(set(refused.values()))))
    runs = list(runs) + sweep_runs(block_sizes or [], DecodeConfig().block_size)
    return [r for r in runs if r.needs() not in missing]


@contextlib.contextmanager
def engine_output_to(path: Path, enabled: bool = True):
    """Send everything written to this process's stdout/stderr (vLLM's logs, its engine
    processes' too: they inherit the descriptors) to `path`; yield a stream on the console."""
    if not enabled:
        yield sys.stdout
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    console = os.fdopen(os.dup(1), "w", buffering=1)
    with open(path, "a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield console
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            console.close()  # the speed probe every engine passes before it is measured


def engine_peak_rss_mb(pids=None) -> float:
    """Peak resident memory (VmHWM) of the processes `pids` (default: this process's children,
    vLLM's engine processes)."""
    import psutil

    if pids is None:
        pids = [child.pid for child in psutil.Process().children(recursive=True)]
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:  # not Linux, or the child is gone
            continue
        total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
    return round(total / 1024, 1)


def kv_capacity_tokens(llm) -> int:
    """Tokens the engine's KV cache holds (blocks x block size) under the same memory budget."""
    cache = llm.llm_engine.vllm_config.cache_config
    return int((cache.num_gpu_blocks or 0) * cache.block_size)


@torch.no_grad()
def off_argmax_share(model, results) -> float:
    """Share of generated tokens that differ from ``model``'s fp32 argmax given the prompt and
    the tokens emitted before them (teacher-forced, one pass per request)."""
    off = total = 0
    for res in results:
        if not res.token_ids:
            continue
        ids = torch.tensor([res.prompt_token_ids + res.token_ids])
        logits = model(ids).logits[0, len(res.prompt_token_ids) - 1: -1]  # [num_tokens, vocab]
        off += int((logits.argmax(-1) != torch.tensor(res.token_ids)).sum())
        total += len(res.token_ids)
    return off / total if total else 0.0


def same_as_reference_share(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """Share of tokens inside each output's common prefix with the reference output."""
    common = sum(common_prefix_length(a, b) for a, b in zip(tokens, reference))
    return common / max(1, sum(len(a) for a in tokens))


IDLE_S = 1.2  # vLLM's shared-memory readers poll busily for 1 s after their last message


@dataclass
class _Engine:
    """One configuration's engine during a bench: its drives per concurrency, its processes."""

    run: EngineRun
    cfg: DecodeConfig
    llm: object
    pids: set
    seconds: float = 0.0  # start-up and drives
    reps: dict = field(default_factory=dict)  # in flight -> [(results, driven, spec delta)]


def _start(run: EngineRun, max_tokens: int, max_num_seqs: int, stack: contextlib.ExitStack,
           defaults: dict | None = None) -> _Engine:
    """Start `run`'s engine inside `stack` and fill it once (the speed probe)."""
    import psutil
    from vllm import SamplingParams

    cfg = run.config(**(defaults or {}), max_tokens=max_tokens)
    t_start = time.perf_counter()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    llm = stack.enter_context(engine_gen.engine(engine_gen.engine_kwargs(cfg, run.flags(cfg),
                                                                         max_num_seqs=max_num_seqs)))
    pids = {p.pid for p in psutil.Process().children(recursive=True)} - before
    # the probe fills the engine: the first full batch then pays no one-off costs
    probe, _ = engine_gen.drive(llm, [PROBE[0]] * max_num_seqs, SamplingParams(temperature=0.0, max_tokens=PROBE[1]),
                                max_num_seqs)
    if not probe[0].token_ids:
        raise RuntimeError(f"{run.label}: the speed probe produced no tokens")
    return _Engine(run, cfg, llm, pids, time.perf_counter() - t_start)


def _drive_once(eng: _Engine, prompts: list[str], params, n: int) -> None:
    """One timed run of `prompts` at `n` in flight, with the engine's counters around it."""
    from vllm_prove.engine import metrics

    t0 = time.perf_counter()
    before = metrics.from_engine_metrics(eng.llm.get_metrics())
    if eng.cfg.method.diffusion:
        engine_gen.sdd_counters(eng.llm, reset=True)
    results, driven = engine_gen.drive(eng.llm, prompts, params, n)
    if eng.cfg.method.diffusion:
        driven["sdd"] = engine_gen.sdd_counters(eng.llm)
    eng.reps.setdefault(n, []).append((results, driven, metrics.from_engine_metrics(eng.llm.get_metrics()) - before))
    eng.seconds += time.perf_counter() - t0


def run_engine_bench(prompts: list[str], *, max_tokens: int = 48, in_flight=(1, 4, 16), runs=None,
                     bf16: bool = False, repeats: int = 1, interleave: bool = False,
                     out_dir: str | Path | None = None, log=print, progress=None, defaults: dict | None = None) -> dict:
    """Run every configuration; `log(line)` gets each table row as its engine finishes;
    `progress` (a stream) shows one bar over all engines and concurrencies. With `repeats` > 1
    each concurrency runs that many times: a row reports the median tokens/s, the median of the
    per-repeat ratios to AR (repeat i against AR's repeat i) and their spread, and the other
    fields of the median repeat.

    Engines run one after another by default, each doing its repeats back to back. With
    `interleave` every engine is up at once and they take turns, `IDLE_S` apart, so a ratio
    compares runs seconds apart, not minutes (this machine's speed drifts by 10-30% over
    minutes); repeat i starts at the i-th engine (AR first in repeat 0), so no engine always
    runs right after AR or last. It needs the memory of all engines at once,
    so it runs on the CPU only (each GPU engine takes vLLM's `gpu_memory_utilization` of 0.9).
    `defaults`: DecodeConfig fields every row starts from (a preset's models and decode settings;
    a row's own fields win)."""
    if repeats < 1:
        raise ProveError(f"--repeats: at least 1, got {repeats}")
    if interleave and torch.cuda.is_available():
        raise ProveError("--interleave: every engine is up at once, and on a GPU each one takes 90% of its memory; "
                         "run without --interleave (one engine at a time) there")
    from tqdm import tqdm

    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from vllm_prove.paths import zoo_path

    runs = list(ENGINE_RUNS if runs is None else runs) + (BF16_RUNS if bf16 else [])
    defaults = dict(defaults or {})
    base = DecodeConfig(**defaults, max_tokens=max_tokens)
    load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # noqa: E731
    proposer = load(base.proposer or zoo_path("proposer"))
    verifier = load(base.verifier or zoo_path("verifier")) if any(r.needs() == "verifier" for r in runs) else None
    costs: dict[tuple[int, int], dict] = {}  # (block size, rows) -> pass seconds, measured once each

    def cost(block: int, n: int) -> dict:
        if (block, n) not in costs:
            costs[(block, n)] = pass_costs(proposer, verifier, block, rows=n)
        return costs[(block, n)]

    for n in in_flight:
        cost(base.block_size, n)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    rows, reference, ar_speeds = [], {}, {}  # [(dtype, n)]: AR's tokens per prompt, its tokens/s per repeat
    bar = tqdm(total=len(runs) * len(in_flight) * repeats, desc="engines", unit="run", file=progress,
               disable=progress is None, dynamic_ncols=True)

    def drive(eng: _Engine, n: int) -> None:
        bar.set_postfix_str(eng.run.label)
        _drive_once(eng, prompts, params, n)
        bar.update()

    def report(eng: _Engine) -> None:
        run_rows = [_row(eng, n, ar_speeds, reference, proposer, cost(eng.cfg.block_size, n)) for n in in_flight]
        peak, capacity = engine_peak_rss_mb(eng.pids), kv_capacity_tokens(eng.llm)
        for row in run_rows:
            row |= {"peak_rss_mb": peak, "kv_capacity_tokens": capacity}
            rows.append(row)
            log(format_row(row))
        log(f"  ({eng.run.label}: engine start + runs {eng.seconds:.0f} s)")

    if interleave:
        with contextlib.ExitStack() as stack:
            engines = [_start(run, max_tokens, max(in_flight), stack, defaults) for run in runs]
            for n in in_flight:
                for i in range(repeats):
                    for eng in engines[i % len(engines):] + engines[: i % len(engines)]:  # (turns rotate)
                        time.sleep(IDLE_S)  # the engine that ran last stops polling its workers
                        drive(eng, n)
            for eng in engines:
                report(eng)
    else:
        for run in runs:
            with contextlib.ExitStack() as stack:
                eng = _start(run, max_tokens, max(in_flight), stack, defaults)
                for n in in_flight:
                    for _ in range(repeats):
                        drive(eng, n)
                report(eng)
    bar.close()
    report_ = {"prompts": len(prompts), "max_tokens": max_tokens, "in_flight": list(in_flight), "repeats": repeats,
               "interleave": interleave, "defaults": defaults,
               "pass_seconds": {f"B={b} n={n}": c for (b, n), c in costs.items()}, "rows": rows,
               "machine": {"cpus": os.cpu_count(), "cuda": torch.cuda.is_available(), "torch": torch.__version__}}
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(report_, indent=2) + "\n")
        plot(rows, out / "bench.png")
    return report_


def _row(eng: _Engine, n: int, ar_speeds: dict, reference: dict, proposer, pass_cost: dict) -> dict:
    """The table row of `eng` at `n` in flight (records AR's speeds and tokens for the rows after it)."""
    cfg, reps = eng.cfg, eng.reps[n]
    repeats = len(reps)
    speeds = [sum(len(r.token_ids) for r in res) / d["seconds"] for res, d, _ in reps]
    if eng.run.label == "ar":
        ar_speeds[(cfg.dtype, n)] = speeds
    ar = ar_speeds.get(("float32", n))
    ratios = sorted(v / a for v, a in zip(speeds, ar)) if ar else None
    results, driven, spec = reps[sorted(range(repeats), key=speeds.__getitem__)[repeats // 2]]
    summary = engine_gen.summarize(cfg.model_copy(update={"batch_size": n}), results, driven, spec)
    tokens = [r.token_ids for r in results]
    if cfg.method is Method.AR and (cfg.dtype, n) not in reference:  # (the control is checked against AR)
        reference[(cfg.dtype, n)] = tokens
    if cfg.method.diffusion:  # SUMMARY.json's SDD fields; no cost model for the drafter's passes
        summary |= engine_gen.sdd_summary(driven["sdd"], summary["num_tokens"])
    ideal = None if cfg.method.diffusion else ideal_speedup(
        max(1.0, summary["committed_per_cycle"]), cycle_cost(cfg.method, cfg.k, pass_cost))
    ratio = ratios[len(ratios) // 2] if ratios else None
    ar_ref = reference.get((cfg.dtype, n))
    return {"label": eng.run.label, "in_flight": n, "dtype": cfg.dtype, **summary,
            "repeats": repeats, "tokens_per_s_repeats": [round(v, 2) for v in speeds],
            "ratio_to_ar": None if ratio is None else round(ratio, 3),
            "ratio_spread": None if ratios is None else [round(ratios[0], 3), round(ratios[-1], 3)],
            "same_as_ar": round(same_as_reference_share(tokens, ar_ref), 4) if ar_ref else None,
            "off_argmax": round(off_argmax_share(proposer, results), 4),
            "ms_per_step": round(1000 * driven["seconds"] / max(1, driven["engine_steps"]), 2),
            "ideal_speedup": None if ideal is None else round(ideal, 3),
            "efficiency": None if ratio is None or ideal is None else round(ratio / ideal, 3)}


HEADER = (f"{'method':<24}{'n':>3}{'tok/s':>8}{'x AR':>6}{'spread':>11}{'commit/cyc':>11}{'K avg':>6}{'K=0':>5}"
          f"{'ms/step':>8}{'=AR':>6}{'off-argmax':>11}{'peak MB':>8}{'KV tok':>7}{'ideal':>7}{'eff':>6}")


def format_row(row: dict) -> str:
    spread = row.get("ratio_spread")
    spread = f"{spread[0]:.2f}-{spread[1]:.2f}" if spread and row.get("repeats", 1) > 1 else "-"
    depth = row.get("adaptive_depth") or {}  # the adaptive depth's mean K and share of plain steps
    plain = depth.get("plain_share")
    return (f"{row['label']:<24}{row['in_flight']:>3}{format_cell(row['tokens_per_s'], '8.1f')}"
            f"{format_cell(row['ratio_to_ar'], '6.2f')}{spread:>11}"
            f"{format_cell(row['committed_per_cycle'], '11.2f')}{format_cell(depth.get('mean_depth'), '6.1f')}"
            f"{'-' if plain is None else f'{100 * plain:.0f}%':>5}"
            f"{format_cell(row.get('ms_per_step'), '8.2f')}{format_cell(row['same_as_ar'], '6.3f')}{format_cell(row['off_argmax'], '11.4f')}{format_cell(row['peak_rss_mb'], '8.0f')}"
            f"{format_cell(row['kv_capacity_tokens'], '7d')}{format_cell(row['ideal_speedup'], '7.2f')}{format_cell(row['efficiency'], '6.2f')}")


def plot(rows: list[dict], path: Path) -> None:
    """Ratio to AR by requests in flight (left) and committed tokens per cycle (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    left.set_prop_cycle(color=plt.cm.tab20.colors)  # distinct colours for up to 20 methods
    for label in labels:
        mine = [r for r in rows if r["label"] == label]
        ratios = [math.nan if r["ratio_to_ar"] is None else r["ratio_to_ar"] for r in mine]
        left.plot([r["in_flight"] for r in mine], ratios, marker="o", label=label)
    left.axhline(1.0, color="grey", lw=0.8)
    in_flight = sorted({r["in_flight"] for r in rows})
    left.set(xscale="log", xlabel="requests in flight", ylabel="tokens/s / vLLM AR", title="throughput vs AR")
    left.set_xticks(in_flight, [str(n) for n in in_flight])
    left.minorticks_off()
    left.legend(fontsize=7)
    first = min(r["in_flight"] for r in rows)
    mine = [next(r for r in rows if r["label"] == label and r["in_flight"] == first) for label in labels]
    right.barh(labels, [r["committed_per_cycle"] for r in mine])
    right.invert_yaxis()
    right.set(xlabel=f"committed tokens per cycle ({first} in flight)", title="tokens per cycle")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
