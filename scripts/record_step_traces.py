"""Record per-step timing traces from real vLLM engines, for the adaptive depth's trace-replay simulator.

For each engine below the script starts ONE vLLM engine on the zoo models (fp32, eager, the
kwargs of ``vllm-prove bench --engine vllm``: ``engine_gen.engine_kwargs``, ``max_num_seqs`` 32),
warms it (the bench's speed probe: a full batch of a short greedy request), and then, at each
number of requests in flight (1, 2, 4, 8, 16, 32), drives the zoo's held-out prompts greedily
(``ignore_eos``, 48 tokens each) keeping that many requests in the engine, as
``engine.generate.drive`` does:

- ``lossless-plain``: ProVe-lossless with ``adaptive_policy="plain"`` (depth 0 every step: the
  AR-equivalent arm of a speculative engine);
- ``lossless-random``: the same with ``adaptive_policy="random"`` (a random draft depth and random
  verify depths every step: every step shape);
- ``sd-random``: vLLM's draft-model SD (the zoo verifier as the drafter, k = 5) under mode
  ``sd`` with ``adaptive_policy="random"``;
- ``ar``: plain vLLM, no speculation (no step log there: tokens/s only, a cross-check).

Per engine and load it records the ``AdaptiveScheduler``'s step log
(``LLM.collective_rpc("prove_step_log", args=(True,))``: one row per engine step, ``columns``
below: the load the step was decided at, its shape, its cycle in seconds from the start of its
``schedule`` to the start of the next one, and the tokens it committed, -1 for none), the
load's tokens/s (output tokens / wall time of the drive), and the delta over the load of
``prove_adaptive_summary``'s ``verified_per_position`` / ``accepted_per_position`` (acceptance per
draft position). A load admits at least ``min(48, 3 * load + 8)`` prompts and keeps admitting
(the held-out prompts cycled) until the engine has run ``--min-steps`` steps, so every load
runs long enough; at most ``--max-rows`` rows are kept per load, a contiguous stretch from the
middle (field ``kept``).

Output: one JSON file per engine in ``tests/core/traces/`` (``<engine>.json``); the engines run
one after another (one engine at a time: ~2 GB and both cores each). Rerun (several minutes):

    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \\
        .venv/bin/python scripts/record_step_traces.py > /tmp/record_step_traces.log 2>&1

``--engines lossless-random ar`` records some engines only; ``--summarize`` prints the summary
table of the files already written, starting no engine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from vllm_prove.engine.generate import prepare_environment  # noqa: E402

prepare_environment()  # before vLLM is imported (its engine processes inherit the environment)

ENGINES = ("lossless-plain", "lossless-random", "sd-random", "ar")
LOADS = (1, 2, 4, 8, 16, 32)
MAX_NUM_SEQS = 32
MAX_TOKENS = 48
BLOCK_SIZE = 8  # the zoo proposer's B
SD_K = 5
COLUMNS = ["load", "requests", "rows", "spec_requests", "draft_depth", "draft_passes", "draft_rows",
           "draft_requests", "prefill_rows", "seconds", "committed"]
OUT_DIR = ROOT / "tests" / "core" / "traces"
PROMPTS = ROOT / "vllm_prove" / "zoo" / "models" / "heldout_prompts.jsonl"


def engine_flags(name: str) -> dict:
    """vLLM flags of an engine: the bench's (``engine_gen.method_flags``) with the policy set."""
    from vllm_prove.config import DecodeConfig, Method
    from vllm_prove.engine import generate as engine_gen

    if name == "ar":
        return engine_gen.method_flags(DecodeConfig(method=Method.AR))
    if name.startswith("lossless-"):
        flags = engine_gen.method_flags(DecodeConfig(method=Method.PROVE_LOSSLESS, block_size=BLOCK_SIZE))
    elif name == "sd-random":
        flags = engine_gen.method_flags(DecodeConfig(method=Method.SD, k=SD_K))  # adaptive: mode "sd"
    else:
        raise ValueError(f"unknown engine {name!r}; choose from {ENGINES}")
    flags["additional_config"]["prove"]["adaptive_policy"] = name.split("-", 1)[1]
    return flags


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown CPU")
    return f"{len(os.sched_getaffinity(0))} CPUs (nproc), {cpu}, {platform.system()} {platform.release()}"


def git_commit() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def drive_load(llm, prompts: list[str], params, load: int, min_prompts: int, min_steps: int) -> dict:
    """Decode prompts (cycled) with ``load`` requests in flight, as ``engine.generate.drive`` does:
    a finished request's slot goes to the next prompt at once. Admits at least ``min_prompts``
    and keeps admitting until the engine has run ``min_steps`` steps, then drains."""
    engine_ = llm.llm_engine
    queue, live, tokens = deque(), set(), {}
    admitted = steps = 0
    t0 = time.perf_counter()
    while True:
        while len(live) < load and (admitted < min_prompts or steps < min_steps):
            rid = str(admitted)
            engine_.add_request(rid, prompts[admitted % len(prompts)], params)
            live.add(rid)
            admitted += 1
        if not live:
            break
        outputs = engine_.step()
        steps += 1
        for out in outputs:
            if out.finished:
                tokens[out.request_id] = len(out.outputs[0].token_ids)
                live.discard(out.request_id)
    seconds = time.perf_counter() - t0
    num_tokens = sum(tokens.values())
    return {"prompts": admitted, "num_tokens": num_tokens, "seconds": round(seconds, 4),
            "engine_steps": steps, "ms_per_step": round(1000 * seconds / max(1, steps), 3),
            "tokens_per_s": round(num_tokens / seconds, 2)}


def per_position_delta(before: dict | None, after: dict | None, key: str) -> list[int] | None:
    if after is None or after.get(key) is None:
        return None
    new, old = list(after[key]), list((before or {}).get(key) or [])
    old += [0] * (len(new) - len(old))
    return [int(a - b) for a, b in zip(new, old)]


def keep_middle(rows: list, max_rows: int) -> tuple[list, str | None]:
    """At most ``max_rows`` contiguous rows from the middle; the stretch kept (1-based, inclusive)."""
    n = len(rows)
    if n <= max_rows:
        return rows, None
    start = (n - max_rows) // 2
    return rows[start:start + max_rows], f"steps {start + 1}..{start + max_rows} of {n}"


def record_engine(name: str, args, prompts: list[str], log) -> dict:
    from vllm import SamplingParams

    from vllm_prove.config import DecodeConfig
    from vllm_prove.engine import generate as engine_gen
    from vllm_prove.eval.engine_bench import PROBE

    flags = engine_flags(name)
    kwargs = engine_gen.engine_kwargs(DecodeConfig(max_tokens=args.max_tokens), flags, max_num_seqs=MAX_NUM_SEQS)
    speculative = name != "ar"
    import vllm

    result = {"engine": name, "machine": machine(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "vllm": vllm.__version__, "commit": git_commit(), "engine_kwargs": kwargs,
              "prompts": "vllm_prove/zoo/models/heldout_prompts.jsonl, cycled",
              "max_tokens": args.max_tokens, "sampling": "greedy, ignore_eos",
              "columns": COLUMNS if speculative else None,
              "notes": ("seconds: the step's cycle, from the start of its schedule to the start of the next "
                        "step's (the last step before the engine idles: to the end of its update_from_output); "
                        "load: the load its depth was decided at; committed: tokens it committed, -1 for none; "
                        "kept: the contiguous stretch of the load's steps kept (1-based, inclusive); "
                        "tokens_per_s: output tokens / wall time of the load's drive; engine_steps: "
                        "LLMEngine.step calls of the drive (ms_per_step: its wall time / them); "
                        "verified/accepted_per_position: prove_adaptive_summary delta over the load"),
              "loads": {}}
    t_start = time.perf_counter()
    with engine_gen.engine(kwargs) as llm:
        log(f"[{name}] engine up in {time.perf_counter() - t_start:.0f} s")
        # warm-up: the bench's speed probe (a full batch of a short request) and one request alone
        engine_gen.drive(llm, [PROBE[0]] * MAX_NUM_SEQS, SamplingParams(temperature=0.0, max_tokens=PROBE[1]),
                         MAX_NUM_SEQS)
        llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=PROBE[1]), use_tqdm=False)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        for load in args.loads:
            before = None
            if speculative:
                llm.collective_rpc("prove_step_log", args=(True,))  # (re)start the log: warm-up and last load out
                before = llm.collective_rpc("prove_adaptive_summary")[0]
            run = drive_load(llm, prompts, params, load, min(48, 3 * load + 8), args.min_steps)
            entry = {"tokens_per_s": run.pop("tokens_per_s"), **run}
            if speculative:
                rows = llm.collective_rpc("prove_step_log", args=(True,))[0] or []
                after = llm.collective_rpc("prove_adaptive_summary")[0]
                kept_rows, kept = keep_middle(rows, args.max_rows)
                entry["observed_steps"] = len(rows)
                if kept is not None:
                    entry["kept"] = kept
                entry["steps"] = kept_rows
                for key in ("verified_per_position", "accepted_per_position"):
                    entry[key] = per_position_delta(before, after, key)
            result["loads"][str(load)] = entry
            log(f"[{name}] load {load:>2}: {entry['prompts']} prompts, {entry['engine_steps']} engine steps, "
                f"{entry['tokens_per_s']:.1f} tok/s" + (f", {entry['observed_steps']} logged" if speculative else ""))
        if speculative:
            llm.collective_rpc("prove_step_log", args=(False,))
    log(f"[{name}] done in {time.perf_counter() - t_start:.0f} s")
    return result


def dumps(result: dict) -> str:
    """JSON with one step row per line (small and diffable)."""
    rows, marked = {}, json.loads(json.dumps(result))
    for load, entry in marked["loads"].items():
        if "steps" in entry:
            for i, row in enumerate(entry["steps"]):
                rows[f"@@{load}:{i}@@"] = json.dumps(row, separators=(",", ":"))
            entry["steps"] = [f"@@{load}:{i}@@" for i in range(len(entry["steps"]))]
        for key in ("verified_per_position", "accepted_per_position"):
            if entry.get(key) is not None:
                rows[f"@@{load}:{key}@@"] = json.dumps(entry[key], separators=(",", ":"))
                entry[key] = f"@@{load}:{key}@@"
    text = json.dumps(marked, indent=1)
    return re.sub(r'"(@@[^"]*@@)"', lambda m: rows[m.group(1)], text) + "\n"


def summarize(out_dir: Path, engines, log) -> None:
    """Per engine and load: steps kept (of those observed), the median step in ms of the decode
    steps (no prompt rows) that are plain (no draft verified, none drafted), that verify drafts
    but draft none (``v``), and that draft D tokens (``D=d``); the steps carrying prompt rows
    (``pf``: their number and median ms); committed tokens per step (of the steps kept), the
    drive's wall time per engine step, and tokens/s."""
    wall_ms = lambda entry: f"{entry['ms_per_step']:.2f}" if "ms_per_step" in entry else "-"  # noqa: E731
    depths = range(1, BLOCK_SIZE + 1)
    log(f"{'engine':<16}{'load':>5}{'steps':>10}{'plain':>7}{'v':>7}"
        + "".join(f"{f'D={d}':>7}" for d in depths) + f"{'pf':>12}{'tok/step':>9}{'wall ms':>8}{'tok/s':>8}")
    for name in engines:
        path = out_dir / f"{name}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        for load, entry in data["loads"].items():
            steps = entry.get("steps")
            if steps is None:
                log(f"{name:<16}{load:>5}{entry['engine_steps']:>10}{'-':>7}{'-':>7}" + f"{'-':>7}" * len(depths)
                    + f"{'-':>12}{'-':>9}{wall_ms(entry):>8}{entry['tokens_per_s']:>8.1f}")
                continue
            col = {c: i for i, c in enumerate(data["columns"])}

            def med(select) -> str:
                ms = [1000 * r[col["seconds"]] for r in steps if select(r)]
                return f"{statistics.median(ms):.2f}" if ms else "-"

            decode = lambda r: r[col["prefill_rows"]] == 0  # noqa: E731
            plain = med(lambda r: decode(r) and r[col["spec_requests"]] == 0 and r[col["draft_depth"]] == 0)
            verify = med(lambda r: decode(r) and r[col["spec_requests"]] > 0 and r[col["draft_depth"]] == 0)
            by_depth = [med(lambda r, d=d: decode(r) and r[col["draft_depth"]] == d) for d in depths]
            prefill = f"{sum(not decode(r) for r in steps)}:{med(lambda r: not decode(r))}"
            committed = [r[col["committed"]] for r in steps if r[col["committed"]] >= 0]
            per_step = sum(committed) / len(committed) if committed else 0.0
            counted = f"{len(steps)}/{entry['observed_steps']}"
            log(f"{name:<16}{load:>5}{counted:>10}{plain:>7}{verify:>7}"
                + "".join(f"{m:>7}" for m in by_depth) + f"{prefill:>12}{per_step:>9.2f}{wall_ms(entry):>8}"
                + f"{entry['tokens_per_s']:>8.1f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--loads", nargs="+", type=int, default=list(LOADS),
                        help=f"requests in flight (at most max_num_seqs = {MAX_NUM_SEQS})")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="tokens per request")
    parser.add_argument("--min-steps", type=int, default=400, help="engine steps a load runs at least")
    parser.add_argument("--max-rows", type=int, default=400, help="step rows kept per load")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--summarize", action="store_true", help="print the table of the files in --out only")
    args = parser.parse_args(argv)
    if any(not 1 <= n <= MAX_NUM_SEQS for n in args.loads):
        parser.error(f"--loads: each between 1 and {MAX_NUM_SEQS}")

    def log(line: str) -> None:
        print(line, flush=True)

    if not args.summarize:
        prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
        args.out.mkdir(parents=True, exist_ok=True)
        for name in args.engines:
            result = record_engine(name, args, prompts, log)
            path = args.out / f"{name}.json"
            path.write_text(dumps(result))
            log(f"[{name}] wrote {path} ({path.stat().st_size / 1024:.0f} KB)")
    summarize(args.out, args.engines, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
