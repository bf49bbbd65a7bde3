"""The default engine from a fresh process, as a new user runs it: ``vllm-prove generate --engine
vllm``, AR and then the default ProVe-lossless (adaptive depth), each in a new process, paired run
by run, at each number of requests in flight. A fresh engine's controller has measured nothing:
what it decides in its first minute is what a user of ``generate`` gets.

    .venv/bin/python scripts/paired_fresh_runs.py --repeats 5 --batch-sizes 1 16 --out runs/fresh

Prints every pair's ratio (lossless tok/s over the AR run right before it) and writes them, with
each run's summary (the adaptive depth's decisions included), to ``OUT/fresh.json``. ``--control``
runs a second AR process after the first in every repeat: its ratio to the first is the noise
floor of a pair of fresh processes (the A/A row of this measurement).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from vllm_prove.zoo import HELDOUT_PROMPTS


def run(method: str, prompts: Path, batch_size: int, max_tokens: int, out: Path) -> dict:
    summary = out.with_suffix(".json")
    subprocess.run([sys.executable, "-m", "vllm_prove.cli", "generate", "--engine", "vllm", "--method", method,
                    "--prompts", str(prompts), "--max-tokens", str(max_tokens), "--batch-size", str(batch_size),
                    "--out", str(out.with_suffix(".jsonl")), "--summary", str(summary)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(summary.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", default="runs/fresh")
    parser.add_argument("--control", action="store_true", help="an AR process against the AR process (A/A)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(HELDOUT_PROMPTS.read_text().splitlines(keepends=True)[: args.num_prompts]))
    rows = []
    for batch_size in args.batch_sizes:
        for repeat in range(args.repeats):
            ar = run("ar", prompts, batch_size, args.max_tokens, out / f"ar-{batch_size}-{repeat}")
            control = None
            if args.control:
                control = run("ar", prompts, batch_size, args.max_tokens, out / f"control-{batch_size}-{repeat}")
                control = round(control["tokens_per_s"] / ar["tokens_per_s"], 3)
            ll = run("prove-lossless", prompts, batch_size, args.max_tokens, out / f"lossless-{batch_size}-{repeat}")
            ratio = ll["tokens_per_s"] / ar["tokens_per_s"]
            depth = ll.get("adaptive_depth") or {}
            rows.append({"batch_size": batch_size, "repeat": repeat, "ratio": round(ratio, 3), "control": control,
                         "ar_tokens_per_s": ar["tokens_per_s"], "lossless_tokens_per_s": ll["tokens_per_s"],
                         "plain_share": depth.get("plain_share"), "realized": depth.get("realized")})
            print(f"in flight {batch_size:2d} run {repeat}: lossless/AR {ratio:.3f} "
                  f"({ll['tokens_per_s']:.1f} / {ar['tokens_per_s']:.1f} tok/s, plain share {depth.get('plain_share')})"
                  + (f", AR/AR {control:.3f}" if control is not None else ""), flush=True)
        ratios = [r["ratio"] for r in rows if r["batch_size"] == batch_size]
        print(f"in flight {batch_size:2d}: median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}")
        controls = [r["control"] for r in rows if r["batch_size"] == batch_size and r["control"] is not None]
        if controls:
            print(f"in flight {batch_size:2d}: AR/AR median {statistics.median(controls):.3f}, "
                  f"range {min(controls):.3f}-{max(controls):.3f}")
    (out / "fresh.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
