"""Benchmark the acceptance-math kernels (``triton_ops``) against their torch twins.

    python scripts/bench_triton_ops.py                        # CUDA, vocab 152,064, 1-256 rows
    python scripts/bench_triton_ops.py --device cpu --rows 1 4 --vocab 4096   # interpreter smoke

For the vocabulary reductions, ``rows`` is ``num_tokens`` (rows of logits); for the block
gates and ``K^`` it is the number of requests, each with ``--block`` draft tokens. GB/s
counts the bytes each operation must move at least once (logits read once, small inputs and
outputs), for the kernel and for the twin alike, and compares it with the H200's copy
bandwidth. On the CPU the kernels run under ``TRITON_INTERPRET=1``: a smoke test of the
script, not a measurement. Results go to a JSON file beside the printed table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

QWEN_VOCAB = 152_064
# H200 HBM3e: 4.8 TB/s peak; ~4.3 TB/s is what a device-to-device copy achieves.
H200_COPY_GBPS = 4300.0
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Case:
    """One operation at one size, runnable by the kernel and by the twin."""

    op: str
    rows: int
    bytes_moved: int
    kernel: Callable[[], object]
    twin: Callable[[], object]


@dataclass(frozen=True)
class Row:
    """One line of the results table."""

    op: str
    rows: int
    kernel_us: float
    twin_us: float
    speedup: float
    kernel_gbps: float
    twin_gbps: float
    kernel_pct_of_h200_copy: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=QWEN_VOCAB, help="logits width (Qwen: 152,064)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256], help="row counts to sweep")
    parser.add_argument("--block", type=int, default=16, help="draft tokens per request (paper: 16)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="logits dtype")
    parser.add_argument("--iters", type=int, default=3, help="CPU only: timed calls per case")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default runs/bench_triton_ops_<device>.json)")
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or args.vocab < 1 or args.block < 1:
        parser.error("--rows, --vocab and --block must be >= 1")
    return args


def make_cases(rows: int, vocab: int, block: int, dtype: torch.dtype, device: torch.device) -> list[Case]:
    from vllm_prove.core import fused

    gen = torch.Generator(device=device).manual_seed(rows)
    logits = torch.randn((rows, vocab), generator=gen, device=device).to(dtype)  # [rows, vocab]
    token_ids = torch.randint(0, vocab, (rows,), generator=gen, device=device)  # [rows]
    num_tokens = rows * block
    cu = torch.arange(1, rows + 1, device=device, dtype=torch.int32) * block  # [rows]
    drafts = torch.randint(0, vocab, (num_tokens,), generator=gen, device=device, dtype=torch.int32)
    targets = torch.where(torch.rand(num_tokens, generator=gen, device=device) < 0.9, drafts, 0)
    bonus = torch.randint(0, vocab, (rows,), generator=gen, device=device)  # [rows]
    probs = torch.rand(num_tokens, generator=gen, device=device) ** 0.1  # [num_tokens]
    logits_bytes = rows * vocab * logits.element_size()

    def both(fn: Callable[..., object], *args: object) -> tuple[Callable[[], object], Callable[[], object]]:
        return (lambda: fn(*args, backend="triton")), (lambda: fn(*args, backend="torch"))

    specs = [
        ("top1_confidence", logits_bytes + rows * 12, both(fused.top1_confidence, logits)),
        ("token_prob", logits_bytes + rows * 12, both(fused.token_prob, logits, token_ids)),
        ("product_gate", num_tokens * 12 + rows * (12 + 8 * (block + 1)),
         both(fused.product_gate_ragged, drafts, probs, probs, cu, 0.05, block)),
        ("lossless_greedy", num_tokens * 12 + rows * (20 + 8 * (block + 1)),
         both(fused.lossless_greedy_ragged, drafts, targets, bonus, cu, block)),
        ("feasible_prefix", num_tokens * 4 + rows * 12,
         both(fused.feasible_prefix_ragged, probs, cu, 0.9, 0.93, "geometric_mean", block)),
    ]
    return [Case(op, rows, nbytes, kernel, twin) for op, nbytes, (kernel, twin) in specs]


def time_us(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median microseconds per call; on CUDA ``do_bench`` flushes L2 between calls."""
    if device.type == "cuda":
        import triton.testing

        return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()  # warm-up: the interpreter's first call parses the kernel
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return 1e6 * sorted(samples)[len(samples) // 2]


def run_case(case: Case, device: torch.device, iters: int) -> Row:
    kernel_us = time_us(case.kernel, device, iters)
    twin_us = time_us(case.twin, device, iters)
    kernel_gbps = case.bytes_moved / kernel_us / 1e3
    return Row(
        op=case.op,
        rows=case.rows,
        kernel_us=kernel_us,
        twin_us=twin_us,
        speedup=twin_us / kernel_us,
        kernel_gbps=kernel_gbps,
        twin_gbps=case.bytes_moved / twin_us / 1e3,
        kernel_pct_of_h200_copy=100.0 * kernel_gbps / H200_COPY_GBPS,
    )


def format_table(results: list[Row]) -> str:
    header = (
        f"{'op':<16} {'rows':>5} {'kernel us':>10} {'twin us':>10} {'speedup':>8} "
        f"{'kernel GB/s':>12} {'twin GB/s':>10} {'% 4.3TB/s':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.op:<16} {r.rows:>5} {r.kernel_us:>10.1f} {r.twin_us:>10.1f} {r.speedup:>8.2f} "
            f"{r.kernel_gbps:>12.4g} {r.twin_gbps:>10.4g} {r.kernel_pct_of_h200_copy:>9.3g}"
        )
    lines.append("rows: logits rows for top1_confidence/token_prob, requests of --block drafts otherwise")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cpu":
        # Must precede the first import of triton_ops: triton.jit reads it at decoration.
        os.environ["TRITON_INTERPRET"] = "1"
    from tqdm import tqdm

    device = torch.device(args.device)
    results = []
    for rows in tqdm(args.rows, desc="rows", file=sys.stderr):
        for case in make_cases(rows, args.vocab, args.block, DTYPES[args.dtype], device):
            results.append(run_case(case, device, args.iters))
    if device.type == "cuda":
        machine = torch.cuda.get_device_name()
    else:
        machine = platform.processor() or platform.machine()
    print(f"device: {machine} ({args.device}); vocab {args.vocab}, block {args.block}, {args.dtype} logits")
    if device.type == "cpu":
        print("CPU: kernels run under TRITON_INTERPRET=1 -- a smoke test, not a measurement")
    print(format_table(results))
    out = args.out or Path("runs") / f"bench_triton_ops_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join([sys.executable, *sys.argv]), "machine": machine, "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
    }, "h200_copy_gbps": H200_COPY_GBPS, "results": [asdict(r) for r in results]}
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
