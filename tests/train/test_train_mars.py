"""Unit tests of the MARS objective (docs/METHODS.md §2): mask, inputs, loss, and the mask as the
model really reads it."""

from __future__ import annotations

import pytest
import torch

from train_tiny import MASK_TOKEN_ID, tiny_qwen2
from vllm_prove.train.data import TokenBatch
from vllm_prove.train.mars import ar_loss, mars_attention_mask, mars_inputs, mars_loss, shifted_ce


def test_train_mask_golden_seq6_block3():
    # Rows are queries, columns keys; clean copy c0..c5 then noisy copy n0..n5.
    # Blocks: positions 0-2 are block 0, 3-5 block 1.
    #            c0 c1 c2 c3 c4 c5   n0 n1 n2 n3 n4 n5
    expected = [[1, 0, 0, 0, 0, 0,   0, 0, 0, 0, 0, 0],  # c0: clean->clean causal,
                [1, 1, 0, 0, 0, 0,   0, 0, 0, 0, 0, 0],  # c1  clean->noisy never
                [1, 1, 1, 0, 0, 0,   0, 0, 0, 0, 0, 0],  # c2
                [1, 1, 1, 1, 0, 0,   0, 0, 0, 0, 0, 0],  # c3
                [1, 1, 1, 1, 1, 0,   0, 0, 0, 0, 0, 0],  # c4
                [1, 1, 1, 1, 1, 1,   0, 0, 0, 0, 0, 0],  # c5
                [0, 0, 0, 0, 0, 0,   1, 0, 0, 0, 0, 0],  # n0: block 0 has no earlier block,
                [0, 0, 0, 0, 0, 0,   1, 1, 0, 0, 0, 0],  # n1  noisy->noisy causal in block
                [0, 0, 0, 0, 0, 0,   1, 1, 1, 0, 0, 0],  # n2
                [1, 1, 1, 0, 0, 0,   0, 0, 0, 1, 0, 0],  # n3: clean of block 0 only,
                [1, 1, 1, 0, 0, 0,   0, 0, 0, 1, 1, 0],  # n4  noisy 3..itself
                [1, 1, 1, 0, 0, 0,   0, 0, 0, 1, 1, 1]]  # n5
    got = mars_attention_mask(6, 3)
    assert got.dtype == torch.bool
    assert got.int().tolist() == expected


@pytest.mark.parametrize("seq_len, block", [(1, 2), (5, 2), (7, 3), (9, 4), (8, 8), (3, 8)])
def test_train_mask_matches_the_rule_written_as_loops(seq_len, block):
    """The rule of docs/METHODS.md §2, one query/key pair at a time, incl. a ragged last block."""
    want = torch.zeros(2 * seq_len, 2 * seq_len, dtype=torch.bool)
    for q in range(seq_len):
        for k in range(seq_len):
            want[q, k] = k <= q  # clean -> clean causal
            want[seq_len + q, k] = k // block < q // block  # noisy -> clean: earlier blocks
            want[seq_len + q, seq_len + k] = k <= q and k // block == q // block  # noisy -> noisy
    assert torch.equal(mars_attention_mask(seq_len, block), want)


def _batch() -> TokenBatch:
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11],
                        [20, 21, 22, 23, 24, 0, 0]])  # [batch, seq]; row 1 right-padded
    response = torch.tensor([[0, 0, 1, 1, 1, 1, 1],
                             [0, 0, 0, 1, 1, 0, 0]], dtype=torch.bool)  # prompt 2 / 3 tokens
    return TokenBatch(ids, response)


def test_train_mars_inputs_mask_response_keep_prompt_repeat_positions():
    batch = _batch()
    got = mars_inputs(batch, mask_token_id=99, block_size=3)
    M = 99
    assert got["input_ids"].tolist() == [
        [5, 6, 7, 8, 9, 10, 11, 5, 6, M, M, M, M, M],  # clean copy, then prompt real + masks
        [20, 21, 22, 23, 24, 0, 0, 20, 21, 22, M, M, 0, 0],  # padding is not response: kept
    ]
    assert got["position_ids"].tolist() == [list(range(7)) * 2] * 2
    assert got["attention_mask"].shape == (2, 1, 14, 14)
    assert torch.equal(got["attention_mask"][1, 0], mars_attention_mask(7, 3))


def _random_logits(batch: TokenBatch, vocab: int = 30, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*batch.input_ids.shape, vocab, generator=gen)  # [batch, seq, vocab]


def test_train_shifted_ce_is_the_mean_over_response_targets():
    batch = _batch()
    logits = _random_logits(batch)
    logp = logits.log_softmax(-1)
    # logit i predicts token i+1; targets counted where token i+1 is a response token
    terms = [-logp[b, i, batch.input_ids[b, i + 1]] for b in range(2) for i in range(6)
             if batch.response_mask[b, i + 1]]
    assert len(terms) == 5 + 2
    assert shifted_ce(logits, batch).item() == pytest.approx(torch.stack(terms).mean().item(), rel=1e-6)


@pytest.mark.parametrize("row, col, supervised", [
    (0, 1, False),  # a prompt token as target
    (0, 0, False),  # position 0 is never a target
    (1, 5, False),  # padding
    (1, 6, False),  # padding, last position
    (0, 2, True),   # first response token (predicted by the last prompt token)
    (0, 6, True),   # last response token
    (1, 4, True),
])
def test_train_shifted_ce_reads_response_targets_only(row, col, supervised):
    batch = _batch()
    logits = _random_logits(batch)
    base = shifted_ce(logits, batch)
    ids = batch.input_ids.clone()
    ids[row, col] = (ids[row, col] + 1) % logits.shape[-1]
    changed = shifted_ce(logits, TokenBatch(ids, batch.response_mask))
    assert (changed.item() != base.item()) == supervised


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@torch.no_grad()
def test_train_mars_mask_is_what_the_model_reads(attn):
    """Through a real Qwen2 forward: clean logits ignore the noisy copy entirely; noisy logits
    of block b ignore clean blocks >= b. (With eager attention the bool mask used to be added
    to the scores as 1/0 and masked nothing.)"""
    from vllm_prove.train.mars import model_attention_mask

    model = tiny_qwen2(attn=attn).eval()
    L, B = 8, 4
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (2, L), generator=gen)
    batch = TokenBatch(ids, torch.ones_like(ids, dtype=torch.bool))

    def logits(inputs):
        inputs = dict(inputs, attention_mask=model_attention_mask(model, inputs["attention_mask"]))
        return model(**inputs).logits  # [batch, 2 * seq, vocab]

    base = mars_inputs(batch, MASK_TOKEN_ID, B)
    ref = logits(base)
    # noisy copy overwritten with arbitrary tokens: the clean half must not move
    noisy_changed = dict(base, input_ids=base["input_ids"].clone())
    noisy_changed["input_ids"][:, L:] = torch.randint(0, 32, (2, L), generator=gen)
    out = logits(noisy_changed)
    assert torch.allclose(out[:, :L], ref[:, :L], atol=1e-5)
    assert not torch.allclose(out[:, L:], ref[:, L:], atol=1e-3)  # the perturbation is felt
    # clean block 1 (positions 4..7) changed: noisy block 1 must not move, noisy block 0 neither
    clean_changed = dict(base, input_ids=base["input_ids"].clone())
    clean_changed["input_ids"][:, B:L] = (clean_changed["input_ids"][:, B:L] + 1) % 32
    out = logits(clean_changed)
    assert torch.allclose(out[:, L:], ref[:, L:], atol=1e-5)
    assert not torch.allclose(out[:, B:L], ref[:, B:L], atol=1e-3)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_train_mars_loss_clean_half_is_the_ar_loss(attn):
    """The clean copy is an ordinary causal pass: its CE equals `ar_loss` on the same batch."""
    model = tiny_qwen2(attn=attn).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (3, 10), generator=gen)
    response = torch.ones_like(ids, dtype=torch.bool)
    response[:, :3] = False
    batch = TokenBatch(ids, response)
    with torch.no_grad():
        parts = mars_loss(model, batch, MASK_TOKEN_ID, 4, ar_weight=0.5)
        plain = ar_loss(model, batch)["ar"]
    assert parts["ar"].item() == pytest.approx(plain.item(), abs=1e-5)
    assert parts["loss"].item() == pytest.approx(parts["block"].item() + 0.5 * parts["ar"].item(), rel=1e-6)
    assert parts["block"].item() != pytest.approx(parts["ar"].item(), abs=1e-3)


def test_train_mars_loss_refuses_attention_without_custom_masks():
    model = tiny_qwen2()
    model.config._attn_implementation = "flash_attention_2"
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="flash_attention_2"):
        mars_loss(model, TokenBatch(ids, torch.ones_like(ids, dtype=torch.bool)), MASK_TOKEN_ID, 4)


@pytest.mark.parametrize("prompt_len, anchor", [(3, "self"), (4, "self"), (6, "self"), (5, "teacher")])
def test_train_mars_loss_with_the_noisy_copy_cut_equals_the_whole_layout(prompt_len, anchor):
    """The loss reads the noisy copy only from the block before the first target, and logits only
    where a term reads them: every term must equal the whole `2L` layout's, computed by hand."""
    import torch.nn.functional as F
    from vllm_prove.train.mars import model_attention_mask, noisy_start, shifted_kl

    model = tiny_qwen2().eval()
    gen = torch.Generator().manual_seed(1)
    L, B = 13, 4
    ids = torch.randint(0, 32, (2, L), generator=gen)
    response = torch.zeros_like(ids, dtype=torch.bool)
    response[:, prompt_len:] = True
    batch = TokenBatch(ids, response)
    assert noisy_start(batch, B) == (prompt_len - 1) // B * B  # 4 (a cut) for prompts of 5 and 6
    teacher = torch.randn(2, L, model.config.vocab_size, generator=gen)
    with torch.no_grad():
        inputs = mars_inputs(batch, MASK_TOKEN_ID, B)
        inputs["attention_mask"] = model_attention_mask(model, inputs["attention_mask"])
        full = model(**inputs).logits  # [batch, 2L, vocab]
        block = shifted_ce(full[:, L:], batch)
        ar = shifted_kl(full[:, :L], teacher, batch, everywhere=True) if anchor == "teacher" else \
            shifted_ce(full[:, :L], batch)
        parts = mars_loss(model, batch, MASK_TOKEN_ID, B, ar_weight=1.0, teacher_logits=teacher, anchor=anchor)
    assert parts["block"].item() == pytest.approx(block.item(), abs=1e-5)
    assert parts["ar"].item() == pytest.approx(ar.item(), abs=1e-5)
    assert F.mse_loss(full[:, :L], full[:, L:]).item() > 1e-4  # the copies differ: the check can fail


def test_train_mars_inputs_cut_keeps_the_layout_of_the_kept_rows():
    ids = torch.arange(10)[None]
    batch = TokenBatch(ids, torch.arange(10)[None] >= 6)
    whole, cut = mars_inputs(batch, 99, 4), mars_inputs(batch, 99, 4, noisy_from=4)
    keep = torch.cat([torch.arange(10), 10 + torch.arange(4, 10)])
    assert torch.equal(cut["input_ids"], whole["input_ids"][:, keep])
    assert torch.equal(cut["position_ids"], whole["position_ids"][:, keep])
    assert torch.equal(cut["attention_mask"][0, 0], whole["attention_mask"][0, 0][keep][:, keep])
    with pytest.raises(ValueError, match="multiple of block_size"):
        mars_inputs(batch, 99, 4, noisy_from=3)
