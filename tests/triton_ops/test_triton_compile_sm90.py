"""Compile every kernel for the H200 (sm_90) down to a cubin, on a machine without a GPU.

The interpreter is lenient where the compiler is not (it accepts, for example, a module
global annotated ``x: tl.constexpr = 1``, which ``triton.compile`` rejects), so passing the
interpreted equality tests does not prove a kernel builds. Triton's wheel ships the NVIDIA
backend and ``ptxas``; compiling ahead of time needs no driver. It runs in a subprocess
because this process decorated the kernels for the interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"

SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton_ops import block_gates, feasible_prefix, vocab_reductions

    H200 = GPUTarget("cuda", 90, 32)
    ALIGNED = 16  # Triton specializes 16-byte-aligned pointers and multiples of 16

    def build(fn, signature, constexprs, num_warps):
        names = fn.arg_names
        full = {**signature, **{name: "constexpr" for name in constexprs}}
        src = ASTSource(
            fn=fn,
            signature=full,
            constexprs={(names.index(k),): v for k, v in constexprs.items()},
            attrs={
                (names.index(k),): [["tt.divisibility", ALIGNED]]
                for k, v in signature.items() if v.startswith("*")
            },
        )
        compiled = triton.compile(src, target=H200, options={"num_warps": num_warps})
        assert compiled.asm["cubin"], fn.__name__
        print("built", fn.__name__, constexprs)

    vocab = {"token_ids_ptr": "*i64", "probs_ptr": "*fp32", "vocab_size": "i32", "logits_row_stride": "i32"}
    for logits in ("*bf16", "*fp16", "*fp32"):
        for fn in (vocab_reductions.top1_confidence_kernel, vocab_reductions.token_prob_kernel):
            build(fn, {"logits_ptr": logits, **vocab}, {"BLOCK_V": vocab_reductions.DEFAULT_BLOCK_V},
                  vocab_reductions.DEFAULT_NUM_WARPS)
    for cu in ("*i32", "*i64"):
        ragged = {"output_token_ids_ptr": "*i64", "num_accepted_ptr": "*i64", "cu_num_draft_tokens_ptr": cu,
                  "draft_token_ids_ptr": "*i32"}
        build(block_gates.product_gate_kernel,
              {**ragged, "proposer_probs_ptr": "*fp32", "verifier_probs_ptr": "*fp32", "theta": "fp32",
               "max_spec_len": "i32"}, {"BLOCK": 32}, 4)
        build(block_gates.lossless_greedy_kernel,
              {**ragged, "target_token_ids_ptr": "*i64", "bonus_token_ids_ptr": "*i64", "max_spec_len": "i32"},
              {"BLOCK": 32}, 4)
        for code in feasible_prefix.GATE_CODES.values():
            build(feasible_prefix.feasible_prefix_kernel,
                  {"k_hat_ptr": "*i64", "cu_num_draft_tokens_ptr": cu, "scores_ptr": "*fp32",
                   "thresholds_ptr": "*fp64"}, {"PREFIX_GATE": code, "BLOCK": 32}, 4)
    print("all-built")
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton wheel has no NVIDIA backend")
def test_every_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a fresh cache: really compile, write nothing to $HOME
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silence Triton 3.9's notice; fusion is the default
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "all-built" in result.stdout
