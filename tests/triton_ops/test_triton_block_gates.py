"""Product gate and lossless compare on ragged blocks: kernel == twin (== core rules)."""

from __future__ import annotations

import pytest
import torch
from triton_cases import assert_verdicts_equal, ragged_batch, requires_cuda

from vllm_prove.core import fused
from vllm_prove.core.contracts import PLACEHOLDER_TOKEN_ID

pytest.importorskip("triton")

PAD = PLACEHOLDER_TOKEN_ID
# (batch, max_spec_len): rows of 0..max_spec_len drafts; 32 is the SDD block (gamma).
RAGGED = [
    (1, 1),
    (3, 4),
    (64, 16),
    (9, 32),
    pytest.param(256, 32, marks=requires_cuda),
]
THETAS = [0.0, 0.05, 0.5, 1.0]


def _gate_inputs(num_tokens: int, theta: float, seed: int, device: torch.device):
    """Draft ids (int32, as vLLM) and probabilities mostly above theta, with exact ties
    ``p~ * q == theta`` (0.5 * 2theta is exact in fp32) and NaN verifier probabilities."""
    gen = torch.Generator().manual_seed(seed)
    draft_token_ids = torch.randint(0, 1000, (num_tokens,), generator=gen, dtype=torch.int32)
    proposer_probs = torch.rand(num_tokens, generator=gen) ** 0.1  # [num_tokens]
    verifier_probs = torch.rand(num_tokens, generator=gen) ** 0.1  # [num_tokens]
    # 0.5 * fp32(2 theta) == fp32(theta) exactly: halving only shifts the exponent.
    tie_p, tie_q = (0.5, 2 * theta) if theta <= 0.5 else (1.0, theta)
    kind = torch.randint(0, 12, (num_tokens,), generator=gen)  # [num_tokens]
    proposer_probs[kind == 0] = tie_p
    verifier_probs[kind == 0] = tie_q
    verifier_probs[kind == 1] = float("nan")
    verifier_probs[kind == 2] = 0.0
    as_device = (t.to(device) for t in (draft_token_ids, proposer_probs, verifier_probs))
    return tuple(as_device)


@pytest.mark.parametrize("batch, max_spec_len", RAGGED)
@pytest.mark.parametrize("theta", THETAS)
def test_product_gate_kernel_matches_twin(batch, max_spec_len, theta, device):
    _, cu_num_draft_tokens = ragged_batch(batch, max_spec_len, seed=batch, device=device)
    num_tokens = int(cu_num_draft_tokens[-1])
    draft_token_ids, proposer_probs, verifier_probs = _gate_inputs(num_tokens, theta, batch, device)
    args = (draft_token_ids, proposer_probs, verifier_probs, cu_num_draft_tokens, theta, max_spec_len)
    kernel = fused.product_gate_ragged(*args, backend="triton")
    twin = fused.product_gate_ragged(*args, backend="torch")
    assert_verdicts_equal(kernel, twin)
    assert kernel.output_token_ids.shape == (batch, max_spec_len + 1)


def test_product_gate_theta_is_compared_in_fp32(device):
    """A theta just above an fp32 score rounds onto it: the score passes on both sides."""
    score = torch.tensor(0.3, dtype=torch.float32)
    theta = float(score) + 1e-12
    cu_num_draft_tokens = torch.tensor([3], dtype=torch.int32, device=device)  # [1]
    draft_token_ids = torch.tensor([5, 6, 7], device=device)  # [3]
    proposer_probs = torch.ones(3, device=device)  # [3]
    verifier_probs = torch.full((3,), float(score), device=device)  # [3]
    args = (draft_token_ids, proposer_probs, verifier_probs, cu_num_draft_tokens, theta, 3)
    for backend in ("torch", "triton"):
        verdict = fused.product_gate_ragged(*args, backend=backend)
        assert verdict.to_lists() == [[5, 6, 7]], backend


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_product_gate_golden(backend, device):
    # s = [0.009, 0.45, 0.045, 0.81] at theta 0.1: y_1 forced, y_2 passes, y_3 fails.
    # Second request: no drafts, nothing committed. Third: y_1 alone, its score ignored.
    cu_num_draft_tokens = torch.tensor([4, 4, 5], dtype=torch.int32, device=device)  # [3]
    draft_token_ids = torch.tensor([11, 12, 13, 14, 21], device=device)  # [5]
    proposer_probs = torch.tensor([0.9, 0.9, 0.9, 0.9, 0.0], device=device)  # [5]
    verifier_probs = torch.tensor([0.01, 0.5, 0.05, 0.9, 0.0], device=device)  # [5]
    verdict = fused.product_gate_ragged(
        draft_token_ids, proposer_probs, verifier_probs, cu_num_draft_tokens, 0.1, 4, backend=backend
    )
    assert verdict.output_token_ids.tolist() == [
        [11, 12, PAD, PAD, PAD],
        [PAD] * 5,
        [21, PAD, PAD, PAD, PAD],
    ]
    assert verdict.num_accepted.tolist() == verdict.num_emitted.tolist() == [2, 0, 1]


def _lossless_inputs(num_tokens: int, batch: int, seed: int, device: torch.device):
    """Targets equal to the drafts 90% of the time, so prefixes run long and some blocks
    are accepted whole (bonus)."""
    gen = torch.Generator().manual_seed(seed)
    draft_token_ids = torch.randint(0, 1000, (num_tokens,), generator=gen, dtype=torch.int32)
    disagree = torch.rand(num_tokens, generator=gen) < 0.1  # [num_tokens]
    other = torch.randint(1000, 2000, (num_tokens,), generator=gen)  # [num_tokens]
    target_token_ids = torch.where(disagree, other, draft_token_ids.long())  # [num_tokens]
    bonus_token_ids = torch.randint(2000, 3000, (batch, 1), generator=gen)  # [batch, 1]
    return tuple(t.to(device) for t in (draft_token_ids, target_token_ids, bonus_token_ids))


@pytest.mark.parametrize("batch, max_spec_len", RAGGED)
def test_lossless_greedy_kernel_matches_twin(batch, max_spec_len, device):
    _, cu_num_draft_tokens = ragged_batch(batch, max_spec_len, seed=7 * batch, device=device)
    num_tokens = int(cu_num_draft_tokens[-1])
    draft_token_ids, target_token_ids, bonus_token_ids = _lossless_inputs(num_tokens, batch, batch, device)
    args = (draft_token_ids, target_token_ids, bonus_token_ids, cu_num_draft_tokens, max_spec_len)
    kernel = fused.lossless_greedy_ragged(*args, backend="triton")
    twin = fused.lossless_greedy_ragged(*args, backend="torch")
    assert_verdicts_equal(kernel, twin)
    assert (kernel.num_emitted == kernel.num_accepted + 1).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_lossless_greedy_golden(backend, device):
    # Rows: mismatch at y_3 (recovered 99); all match (bonus 7); no drafts (bonus 8 alone).
    cu_num_draft_tokens = torch.tensor([4, 6, 6], dtype=torch.int32, device=device)  # [3]
    draft_token_ids = torch.tensor([11, 12, 13, 14, 21, 22], dtype=torch.int32, device=device)
    target_token_ids = torch.tensor([11, 12, 99, 14, 21, 22], device=device)  # [6]
    bonus_token_ids = torch.tensor([[6], [7], [8]], device=device)  # [3, 1]
    verdict = fused.lossless_greedy_ragged(
        draft_token_ids, target_token_ids, bonus_token_ids, cu_num_draft_tokens, 4, backend=backend
    )
    assert verdict.output_token_ids.tolist() == [
        [11, 12, 99, PAD, PAD],
        [21, 22, 7, PAD, PAD],
        [8, PAD, PAD, PAD, PAD],
    ]
    assert verdict.num_accepted.tolist() == [2, 2, 0]
    assert verdict.num_emitted.tolist() == [3, 3, 1]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_perfect_verifier_accepts_everything(backend, device):
    num_draft_tokens, cu_num_draft_tokens = ragged_batch(16, 8, seed=5, device=device)
    num_tokens = int(cu_num_draft_tokens[-1])
    draft_token_ids = torch.arange(num_tokens, device=device)  # [num_tokens]
    bonus_token_ids = torch.full((16,), 10_000, device=device)  # [16]
    ones = torch.ones(num_tokens, device=device)  # [num_tokens]
    lossless = fused.lossless_greedy_ragged(
        draft_token_ids, draft_token_ids, bonus_token_ids, cu_num_draft_tokens, 8, backend=backend
    )
    gate = fused.product_gate_ragged(
        draft_token_ids, ones, ones, cu_num_draft_tokens, 1.0, 8, backend=backend
    )
    assert torch.equal(lossless.num_accepted, num_draft_tokens)
    assert torch.equal(gate.num_accepted, num_draft_tokens)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_batches(backend, device):
    none = torch.zeros(0, dtype=torch.int32, device=device)  # [0]
    no_probs = torch.zeros(0, device=device)  # [0]
    gate = fused.product_gate_ragged(none, no_probs, no_probs, none, 0.1, 4, backend=backend)
    assert gate.output_token_ids.shape == (0, 5)
    # Two requests without drafts: each emits its bonus token alone.
    cu_num_draft_tokens = torch.zeros(2, dtype=torch.int32, device=device)  # [2]
    bonus_token_ids = torch.tensor([3, 4], device=device)  # [2]
    verdict = fused.lossless_greedy_ragged(none, none, bonus_token_ids, cu_num_draft_tokens, 2, backend=backend)
    assert verdict.to_lists() == [[3], [4]]
