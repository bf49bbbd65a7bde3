"""Skip-policy feasible prefix K^ on ragged blocks: kernel == twin (== skip_policy)."""

from __future__ import annotations

import pytest
import torch
from triton_cases import ragged_batch, requires_cuda

from vllm_prove.core import fused
from vllm_prove.core.skip_policy import PrefixGate

pytest.importorskip("triton")
# The interpreter evaluates tl.log with numpy, which warns on log 0 = -inf (intended here).
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")

RAGGED = [
    (1, 1),
    (5, 6),
    (64, 16),
    (33, 32),
    pytest.param(256, 32, marks=requires_cuda),
]
# (eta_b, eta_c): the paper's raw-confidence setting, a loose one, and both extremes.
ETAS = [(0.9, 0.93), (0.5, 0.2), (0.0, 0.0), (1.0, 1.0)]


def _scores(num_tokens: int, eta_b: float, eta_c: float, seed: int, dtype: torch.dtype):
    """Scores near 1 (long prefixes) with exact ties at eta_b and eta_c, zeros, ones and NaN."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, generator=gen, dtype=torch.float64) ** 0.05  # [num_tokens]
    kind = torch.randint(0, 16, (num_tokens,), generator=gen)  # [num_tokens]
    scores[kind == 0] = eta_b
    scores[kind == 1] = eta_c
    scores[kind == 2] = 1.0
    scores[kind == 3] = 0.0
    scores[kind == 4] = float("nan")
    return scores.to(dtype)


@pytest.mark.parametrize("batch, max_spec_len", RAGGED)
@pytest.mark.parametrize("eta_b, eta_c", ETAS)
@pytest.mark.parametrize("gate", list(PrefixGate), ids=lambda gate: gate.value)
def test_feasible_prefix_kernel_matches_twin(batch, max_spec_len, eta_b, eta_c, gate, device):
    _, cu_num_draft_tokens = ragged_batch(batch, max_spec_len, seed=3 * batch, device=device)
    num_tokens = int(cu_num_draft_tokens[-1])
    dtype = torch.float32 if batch % 2 else torch.float64
    scores = _scores(num_tokens, eta_b, eta_c, seed=batch, dtype=dtype).to(device)
    args = (scores, cu_num_draft_tokens, eta_b, eta_c, gate, max_spec_len)
    kernel = fused.feasible_prefix_ragged(*args, backend="triton")  # [batch]
    twin = fused.feasible_prefix_ragged(*args, backend="torch")  # [batch]
    assert kernel.dtype == twin.dtype == torch.int64
    assert torch.equal(kernel, twin), (kernel, twin)


GOLDEN = [
    # The geometric mean is not monotone: C_1 = 0.5 fails, C_4 = 0.5^(1/4) = 0.84 passes,
    # and the maximum is taken literally.
    (PrefixGate.GEOMETRIC_MEAN, [0.5, 1.0, 1.0, 1.0], 0.4, 0.8, 4),
    (PrefixGate.MIN, [0.5, 1.0, 1.0, 1.0], 0.4, 0.8, 0),
    # Exact tie in log space: log 0.5 + log 0.5 == log 0.25 (doubling is exact).
    (PrefixGate.PRODUCT, [0.5, 0.5, 1.0, 0.9], 0.5, 0.25, 3),
    # Exact tie in the local gate, then a NaN ends every later prefix.
    (PrefixGate.MIN, [0.7, 0.9, float("nan"), 1.0], 0.7, 0.7, 2),
    (PrefixGate.PRODUCT, [1.0, 1.0, 0.0, 1.0], 0.0, 0.0, 4),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("gate, scores, eta_b, eta_c, k_hat", GOLDEN)
def test_feasible_prefix_golden(gate, scores, eta_b, eta_c, k_hat, backend, device):
    # The same block twice: once whole, once cut to its first two tokens.
    flat = torch.tensor(scores + scores[:2], dtype=torch.float64, device=device)  # [6]
    cu_num_draft_tokens = torch.tensor([4, 6], dtype=torch.int32, device=device)  # [2]
    got = fused.feasible_prefix_ragged(flat, cu_num_draft_tokens, eta_b, eta_c, gate, 4, backend=backend)
    assert got.tolist()[0] == k_hat
    assert got.tolist()[1] <= 2
