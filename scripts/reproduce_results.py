"""Every run behind docs/RESULTS.md, in order (thin: each step is one `vllm-prove` command).

    .venv/bin/python scripts/reproduce_results.py            # all steps (~1 h on 2 CPU cores)
    .venv/bin/python scripts/reproduce_results.py --list     # the commands
    .venv/bin/python scripts/reproduce_results.py --only concurrency block-size
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from vllm_prove.cli import main as vllm_prove

OUT = "runs/results"
HELDOUT = "vllm_prove/zoo/models/heldout_prompts.jsonl"
STEPS = {
    # the acceptance command: two engine actors, lossless = AR's pass@1, speed of both
    "humaneval-8": f"eval --tasks humaneval --methods ar,prove-lossless --limit 8 --ray --out {OUT}/humaneval-8",
    # quality and speed of every vLLM method on HumanEval (164) and the held-out completions (64)
    "zoo": f"eval --tasks humaneval,heldout --methods ar,sd:k=5,mars,prove:theta=0.1,prove:theta=0.05,prove-lossless "
           f"--ray --out {OUT}/zoo",
    # ProVe appendix D: the speedup as requests in flight grow
    "concurrency": f"eval --tasks heldout --methods ar,prove-lossless,prove:theta=0.1 --concurrency 1,4,16,32 "
                   f"--out {OUT}/concurrency",
    # ProVe Table 4: block size
    "block-size": f"eval --tasks heldout --methods ar,prove-lossless:block_size=4,prove-lossless,"
                  f"prove-lossless:block_size=16,prove:theta=0.1:block_size=4,prove:theta=0.1,"
                  f"prove:theta=0.1:block_size=16 --out {OUT}/block-size",
    # ProVe §3.1 / Fig. 2: AR-matching prefix vs what MARS commits; AUC of p~, q and p~ * q
    "ar-match-mars": f"generate --engine reference --method mars --track-ar-match --prompts {HELDOUT} --max-tokens 48 "
                     f"--out {OUT}/ar-match/mars.jsonl --summary {OUT}/ar-match/mars.json",
    "ar-match-prove": f"generate --engine reference --method prove --track-ar-match --prompts {HELDOUT} --max-tokens 48 "
                      f"--out {OUT}/ar-match/prove.jsonl --summary {OUT}/ar-match/prove.json",
    # the SDD paper: frontier of the skipping signals, K_min sweep, permutation diagnostic
    "sdd": f"sweep sdd --batch-size 1 --quick --out {OUT}/sweep-sdd",  # one request in flight, as the paper
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(STEPS))
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    for name in args.only or STEPS:
        command = STEPS[name]
        print(f"== {name}: vllm-prove {command}", flush=True)
        if args.list:
            continue
        os.makedirs(f"{OUT}/ar-match", exist_ok=True)  # `generate` writes into an existing folder
        start = time.perf_counter()
        status = vllm_prove(shlex.split(command))
        print(f"== {name}: exit {status} after {time.perf_counter() - start:.0f} s", flush=True)
        if status:
            return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
