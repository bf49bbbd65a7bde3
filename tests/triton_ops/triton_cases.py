"""Inputs shared by the kernel-vs-twin tests: ragged batches and logits with edge cases.

Nothing here imports ``triton_ops``: the kernels are reached through ``vllm_prove.core.fused``
after ``conftest.py`` has chosen between the GPU and the interpreter.
"""

from __future__ import annotations

import pytest
import torch

from vllm_prove.core.contracts import Verdict

NEG_INF = float("-inf")
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (full-size and CUDA-dispatch cases)"
)


def ragged_batch(
    batch: int, max_spec_len: int, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:  # [batch] int64, [batch] int32
    """Draft counts in ``0..max_spec_len`` (row 0 full, the last row empty when batch > 2)
    and vLLM's ``cu_num_draft_tokens`` (int32, inclusive cumulative sum)."""
    gen = torch.Generator().manual_seed(seed)
    num_draft_tokens = torch.randint(0, max_spec_len + 1, (batch,), generator=gen)  # [batch]
    num_draft_tokens[0] = max_spec_len
    if batch > 2:
        num_draft_tokens[-1] = 0
    cu_num_draft_tokens = num_draft_tokens.cumsum(0).to(torch.int32)  # [batch]
    return num_draft_tokens.to(device), cu_num_draft_tokens.to(device)


def logits_with_edge_cases(
    rows: int, vocab: int, dtype: torch.dtype, seed: int, device: torch.device
) -> torch.Tensor:  # [rows, vocab]
    """Random logits with, when the shape allows: an all -inf row, a row that is -inf except
    two tied maxima and one smaller entry, tied maxima inside one chunk and far apart (a
    vocabulary chunk apart at full size), and scattered -inf entries."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn((rows, vocab), generator=gen) * 4  # [rows, vocab]
    logits[torch.rand((rows, vocab), generator=gen) < 0.1] = NEG_INF
    if rows >= 4 and vocab >= 8:
        logits[0] = NEG_INF
        logits[1] = NEG_INF
        logits[1, [vocab // 2, vocab - 1]] = 3.0
        logits[1, 1] = 2.0
        top = logits[2:].nan_to_num(neginf=0.0).abs().max() + 1
        logits[2, [3, 5]] = top  # tie inside one chunk
        logits[3, [2, vocab - 1]] = top  # tie across chunks when vocab > BLOCK_V
    return logits.to(dtype).to(device)


def token_ids_with_edge_cases(
    # [rows, vocab]
    logits: torch.Tensor,
    seed: int,
) -> torch.Tensor:  # [rows] int64
    """Per row: the argmax, a random token, or a token whose logit is -inf, in turn."""
    rows, vocab = logits.shape
    gen = torch.Generator().manual_seed(seed)
    cpu = logits.float().cpu()  # [rows, vocab]
    token_ids = torch.randint(0, vocab, (rows,), generator=gen)  # [rows]
    for row in range(rows):
        masked = torch.nonzero(cpu[row] == NEG_INF)[:, 0]
        if row % 3 == 0:
            token_ids[row] = int(cpu[row].argmax())
        elif row % 3 == 2 and masked.numel() > 0:
            token_ids[row] = int(masked[0])
    return token_ids.to(logits.device)


def assert_verdicts_equal(kernel: Verdict, twin: Verdict) -> None:
    """Exact equality of every field, dtype included."""
    for name in ("num_accepted", "output_token_ids", "num_emitted"):
        got, want = getattr(kernel, name), getattr(twin, name)
        assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
        assert torch.equal(got.cpu(), want.cpu()), (name, got, want)
