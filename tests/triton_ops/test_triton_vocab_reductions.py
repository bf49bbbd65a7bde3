"""Top-1 confidence and token probability: kernel == twin, and twin == softmax."""

from __future__ import annotations

import math

import pytest
import torch
from triton_cases import NEG_INF, logits_with_edge_cases, requires_cuda, token_ids_with_edge_cases

from vllm_prove.core import fused

pytest.importorskip("triton")

QWEN_VOCAB = 152_064
# (rows, vocab). 4,096 is exactly one chunk at the default BLOCK_V; 4,097 spills one lane
# into a second. Under the interpreter a full-vocabulary row costs ~0.1 s, so one small-row
# case runs there; the large ones wait for a GPU.
SHAPES = [
    (1, 1),
    (3, 7),
    (64, 1000),
    (17, 4096),
    (6, 4097),
    (2, QWEN_VOCAB),
    pytest.param(64, QWEN_VOCAB, marks=requires_cuda),
    pytest.param(256, QWEN_VOCAB, marks=requires_cuda),
]
DTYPES = [torch.float32, torch.bfloat16]
# fp32 with different summation orders (chunked online sum vs torch.logsumexp); GPU exp is
# an approximation good to a few ulp, and flushes denormals (atol).
PROB_TOL = dict(rtol=2e-5, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("rows, vocab", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_top1_confidence_kernel_matches_twin(rows, vocab, dtype, device):
    logits = logits_with_edge_cases(rows, vocab, dtype, seed=rows + vocab, device=device)
    token_ids, probs = fused.top1_confidence(logits, backend="triton")  # [rows] each
    want_ids, want_probs = fused.top1_confidence(logits, backend="torch")  # [rows] each
    assert token_ids.dtype == want_ids.dtype == torch.int64
    assert probs.dtype == want_probs.dtype == torch.float32
    assert torch.equal(token_ids, want_ids)
    torch.testing.assert_close(probs, want_probs, **PROB_TOL)


@pytest.mark.parametrize("rows, vocab", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_token_prob_kernel_matches_twin(rows, vocab, dtype, device):
    logits = logits_with_edge_cases(rows, vocab, dtype, seed=rows * vocab, device=device)
    token_ids = token_ids_with_edge_cases(logits, seed=rows)  # [rows]
    probs = fused.token_prob(logits, token_ids, backend="triton")  # [rows]
    want = fused.token_prob(logits, token_ids, backend="torch")  # [rows]
    assert probs.dtype == want.dtype == torch.float32
    torch.testing.assert_close(probs, want, **PROB_TOL)
    # A -inf logit has probability exactly 0 on both sides, not merely a small number.
    at_neg_inf = logits.float().gather(1, token_ids[:, None])[:, 0] == NEG_INF  # [rows]
    finite_row = torch.isfinite(logits.float()).any(dim=-1)  # [rows]
    assert (probs[at_neg_inf & finite_row] == 0).all()


def test_kernels_read_a_strided_view(device):
    wide = logits_with_edge_cases(8, 5000, torch.float32, seed=3, device=device)  # [8, 5000]
    logits = wide[:, :4500]  # [8, 4500], row stride 5000
    token_ids = token_ids_with_edge_cases(logits, seed=3)  # [8]
    (got_ids, got_probs), (want_ids, want_probs) = (
        fused.top1_confidence(logits, backend=backend) for backend in ("triton", "torch")
    )
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_probs, want_probs, **PROB_TOL)
    got, want = (fused.token_prob(logits, token_ids, backend=backend) for backend in ("triton", "torch"))
    torch.testing.assert_close(got, want, **PROB_TOL)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_top1_confidence_golden(backend, device):
    logits = torch.tensor(
        [
            [0.0, math.log(3.0), NEG_INF],  # softmax (1/4, 3/4, 0)
            [2.0, 1.0, 2.0],  # tie: the lowest index wins
            [NEG_INF, 5.0, NEG_INF],  # one finite entry: probability 1
            [NEG_INF, NEG_INF, NEG_INF],  # no distribution: argmax 0, NaN
        ],
        device=device,
    )  # [4, 3]
    token_ids, probs = fused.top1_confidence(logits, backend=backend)
    assert token_ids.tolist() == [1, 0, 1, 0]
    tie = 1.0 / (2.0 + math.exp(-1.0))
    want = torch.tensor([0.75, tie, 1.0, float("nan")], device=device)
    torch.testing.assert_close(probs, want, rtol=1e-6, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_token_prob_golden(backend, device):
    logits = torch.tensor(
        [[0.0, math.log(3.0), NEG_INF], [0.0, math.log(3.0), NEG_INF], [NEG_INF] * 3], device=device
    )  # [3, 3]
    token_ids = torch.tensor([0, 2, 1], device=device)  # [3]
    probs = fused.token_prob(logits, token_ids, backend=backend)  # [3]
    want = torch.tensor([0.25, 0.0, float("nan")], device=device)
    torch.testing.assert_close(probs, want, rtol=1e-6, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_twins_match_a_materialized_softmax(dtype):
    """The twins' conventions are torch's: lowest-index argmax, probabilities from softmax."""
    logits = logits_with_edge_cases(64, 5000, dtype, seed=11, device=torch.device("cpu"))
    logits = logits.round()  # many exact ties among the maxima
    token_ids = token_ids_with_edge_cases(logits, seed=11)  # [64]
    softmax = torch.softmax(logits.float(), dim=-1)  # [64, 5000]
    top1_ids, top1_probs = fused.top1_confidence_torch(logits)
    first_max = torch.stack([torch.nonzero(row == row.max())[0, 0] for row in logits.float()])
    assert torch.equal(top1_ids, first_max)
    torch.testing.assert_close(top1_probs, softmax.max(dim=-1).values, equal_nan=True)
    picked = softmax.gather(1, token_ids[:, None])[:, 0]  # [64]
    torch.testing.assert_close(fused.token_prob_torch(logits, token_ids), picked, equal_nan=True)
