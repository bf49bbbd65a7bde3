"""Measure a ProVe mode inside vLLM on the zoo's held-out prompts (a thin script).

    python -m vllm_prove.engine.measure --mode verifier --theta 0.1 --out runs/engine_verifier.json

Runs one engine (fp32, eager, CPU or GPU), decodes every held-out prompt greedily with
``--in-flight`` requests at a time, and prints committed tokens per cycle and acceptance per
draft position as vLLM's spec-decode metrics count them (``metrics``), plus throughput.
Needs ``VLLM_CPU_KVCACHE_SPACE`` on the CPU; must run as ``__main__`` (vLLM spawns workers).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from vllm_prove.config import EngineMode, ProveEngineConfig


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, ProveEngineConfig]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=[m.value for m in EngineMode] + ["off"], default="lossless")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--theta", type=float, default=0.1)
    p.add_argument("--tau", type=float, default=0.95)
    p.add_argument("--gate", default="product")
    p.add_argument("--proposer", default=None, help="served model (default: the zoo's proposer)")
    p.add_argument("--verifier", default=None, help="verifier (default: the zoo's, in verifier mode)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--in-flight", type=int, default=16)
    p.add_argument("--out", default=None, help="write the summary as JSON here")
    args = p.parse_args(argv)
    from vllm_prove.zoo import ZOO_DIR

    args.proposer = args.proposer or str(ZOO_DIR / "proposer")
    settings = None
    if args.mode != "off":
        verifier = (args.verifier or str(ZOO_DIR / "verifier")) if args.mode == "verifier" else None
        settings = ProveEngineConfig(mode=args.mode, block_size=args.block_size, theta=args.theta, tau=args.tau,
                                     gate=args.gate, verifier=verifier)
    return args, settings


def main(argv: list[str] | None = None) -> dict:
    args, settings = parse_args(argv)
    from vllm import LLM, SamplingParams

    from vllm_prove.engine import metrics
    from vllm_prove.zoo import HELDOUT_PROMPTS

    prompts = [json.loads(line)["prompt"] for line in HELDOUT_PROMPTS.read_text().splitlines()]
    extra = {} if settings is None else {"additional_config": {"prove": settings.model_dump(mode="json")}}
    llm = LLM(model=args.proposer, dtype="float32", enforce_eager=True, seed=0, max_num_seqs=args.in_flight,
              disable_log_stats=False, **extra)
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens), use_tqdm=True)
    seconds = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    summary = {"mode": args.mode, "settings": None if settings is None else settings.model_dump(mode="json"),
               "prompts": len(prompts), "in_flight": args.in_flight, "num_tokens": num_tokens,
               "seconds": round(seconds, 3), "tokens_per_s": round(num_tokens / seconds, 1),
               "spec_decode": metrics.from_engine_metrics(llm.get_metrics()).to_json()}
    spec = summary["spec_decode"]
    print(f"{args.mode}: {num_tokens} tokens in {seconds:.2f} s ({summary['tokens_per_s']} tok/s), "
          f"committed/cycle {spec['committed_per_cycle']}, acceptance per position {spec['acceptance_per_position']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
