"""Device dispatch of ``vllm_prove.core.fused``: kernels on CUDA, twins elsewhere."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from triton_cases import requires_cuda

from vllm_prove.core import fused


def _no_kernels(module: str):
    raise AssertionError(f"triton_ops.{module} must not be used here")


def test_auto_uses_the_twins_on_cpu(monkeypatch):
    monkeypatch.setattr(fused, "_kernels", _no_kernels)
    logits = torch.randn(3, 10)  # [3, 10]
    token_ids, probs = fused.top1_confidence(logits)
    assert torch.equal(token_ids, logits.argmax(-1))
    cu_num_draft_tokens = torch.tensor([2, 3])  # [2]
    verdict = fused.lossless_greedy_ragged(
        torch.tensor([1, 2, 3]), torch.tensor([1, 5, 3]), torch.tensor([9, 8]), cu_num_draft_tokens, 2
    )
    assert verdict.to_lists() == [[1, 5], [3, 8]]


def test_forcing_triton_on_cpu_without_the_interpreter_fails_clearly(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        fused.top1_confidence(torch.randn(2, 5), backend="triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_thresholds_are_validated_on_both_backends(backend):
    cu_num_draft_tokens = torch.tensor([1])  # [1]
    one = torch.ones(1)  # [1]
    with pytest.raises(ValueError, match="theta"):
        fused.product_gate_ragged(torch.tensor([4]), one, one, cu_num_draft_tokens, 1.5, 1, backend=backend)
    with pytest.raises(ValueError, match="eta_c"):
        fused.feasible_prefix_ragged(one, cu_num_draft_tokens, 0.5, float("nan"), "min", 1, backend=backend)
    with pytest.raises(ValueError):
        fused.top1_confidence(one, backend="gpu")


def test_core_runs_without_triton():
    """The CPU path never imports Triton: block it and run every public function."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # any `import triton` now raises
        import torch
        from vllm_prove.core import fused
        logits = torch.randn(4, 9)
        ids, probs = fused.top1_confidence(logits)
        fused.token_prob(logits, ids)
        cu = torch.tensor([3, 4])
        fused.product_gate_ragged(ids[:4], probs, probs, cu, 0.1, 3)
        fused.lossless_greedy_ragged(ids, ids, ids[:2], cu, 3)
        fused.feasible_prefix_ragged(probs, cu, 0.5, 0.5, "geometric_mean", 3)
        assert not any(name.startswith("triton_ops") for name in sys.modules)
        print("twins-ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "twins-ok" in result.stdout


@requires_cuda
def test_auto_uses_the_kernels_on_cuda(monkeypatch):
    calls = []
    real = fused._kernels

    def spy(module: str):
        calls.append(module)
        return real(module)

    monkeypatch.setattr(fused, "_kernels", spy)
    logits = torch.randn(4, 1000, device="cuda")  # [4, 1000]
    token_ids, _ = fused.top1_confidence(logits)
    fused.token_prob(logits, token_ids)
    assert calls == ["vocab_reductions", "vocab_reductions"]
