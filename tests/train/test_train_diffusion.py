"""The block-diffusion drafter objective (docs/METHODS.md §7, train/diffusion.py)."""

from __future__ import annotations

import pytest
import torch

from train_tiny import MASK_TOKEN_ID, CountingLanguage, tiny_qwen2
from vllm_prove.config import TrainConfig
from vllm_prove.reference.drafter import DiffusionDrafter
from vllm_prove.train.data import TokenBatch
from vllm_prove.train.diffusion import (NO_BLOCK, diffusion_attention_mask, diffusion_logits, diffusion_loss,
                                        response_blocks, sample_noise)
from vllm_prove.train.trainer import train


def _batch() -> TokenBatch:
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])  # context 5 6, response 7 8 | 9 10 (gamma 2)
    resp = torch.tensor([[False, False, True, True, True, True]])
    return TokenBatch(ids, resp)


def test_blocks_count_from_the_response_start():
    assert response_blocks(_batch(), 2).tolist() == [[NO_BLOCK, NO_BLOCK, 0, 0, 1, 1]]
    ragged = TokenBatch(torch.zeros(1, 6, dtype=torch.long), torch.tensor([[False, True, True, True, True, False]]))
    assert response_blocks(ragged, 3).tolist() == [[NO_BLOCK, 0, 0, 0, 1, NO_BLOCK]]


def test_attention_mask_golden():
    blocks = response_blocks(_batch(), 2)
    start = torch.tensor([[0, 1, 2, 2, 4, 4]])  # context: itself; response: its block's first position
    #            c0 c1 c2 c3 c4 c5   n0 n1 n2 n3 n4 n5
    expected = [[1, 0, 0, 0, 0, 0,   0, 0, 0, 0, 0, 0],  # clean: causal, never the noisy copy
                [1, 1, 0, 0, 0, 0,   0, 0, 0, 0, 0, 0],
                [1, 1, 1, 0, 0, 0,   0, 0, 0, 0, 0, 0],
                [1, 1, 1, 1, 0, 0,   0, 0, 0, 0, 0, 0],
                [1, 1, 1, 1, 1, 0,   0, 0, 0, 0, 0, 0],
                [1, 1, 1, 1, 1, 1,   0, 0, 0, 0, 0, 0],
                [1, 0, 0, 0, 0, 0,   1, 0, 0, 0, 0, 0],  # noisy context: clean causal + itself (no loss)
                [1, 1, 0, 0, 0, 0,   0, 1, 0, 0, 0, 0],
                [1, 1, 0, 0, 0, 0,   0, 0, 1, 1, 0, 0],  # block 0: clean before it, its block both ways
                [1, 1, 0, 0, 0, 0,   0, 0, 1, 1, 0, 0],
                [1, 1, 1, 1, 0, 0,   0, 0, 0, 0, 1, 1],  # block 1: clean context + block 0
                [1, 1, 1, 1, 0, 0,   0, 0, 0, 0, 1, 1]]
    assert diffusion_attention_mask(blocks, start)[0].int().tolist() == expected


def test_noise_masks_only_response_tokens_and_every_block_at_least_once():
    gen = torch.Generator().manual_seed(0)
    batch = TokenBatch(torch.zeros(64, 40, dtype=torch.long),
                       torch.arange(40)[None, :].expand(64, -1) >= 8)  # context 8, response 32
    blocks = response_blocks(batch, 8)
    masked = sample_noise(blocks, 0.05, gen)
    assert not masked[:, :8].any()
    per_block = masked[:, 8:].view(64, 4, 8).sum(-1)  # [batch, blocks]
    assert (per_block >= 1).all()
    ratio = masked[:, 8:].float().mean().item()  # E[r] = (0.05 + 1) / 2
    assert 0.45 < ratio < 0.60


@pytest.mark.parametrize("shift", [False, True])
def test_a_masked_token_is_never_visible_to_its_own_prediction(shift):
    """Changing the true tokens under the masks of block 0 changes nothing block 0 predicts."""
    model = tiny_qwen2(seed=3).eval()
    batch = TokenBatch(torch.tensor([[1, 4, 7, 10, 13, 16, 19, 22]]), torch.tensor([[False, False] + [True] * 6]))
    masked = torch.tensor([[False, False, True, False, True, False, True, True]])  # block 0 = positions 2..4
    other = batch.input_ids.clone()
    other[0, 2], other[0, 4] = 30, 31  # the masked tokens of block 0
    with torch.no_grad():
        a = diffusion_logits(model, batch, MASK_TOKEN_ID, 3, masked, shift)
        b = diffusion_logits(model, TokenBatch(other, batch.response_mask), MASK_TOKEN_ID, 3, masked, shift)
    torch.testing.assert_close(a[0, 2:5], b[0, 2:5])
    assert not torch.allclose(a[0, 5:], b[0, 5:])  # block 1 does read block 0's real tokens


@pytest.mark.parametrize("shift", [False, True])
def test_kept_positions_are_the_full_outputs_there_and_the_loss_reads_only_masks(shift):
    """The output layer runs on the masked positions only: the same logits as the full
    [batch, seq, vocab] there, and the loss is the full logits' CE over the masks."""
    model = tiny_qwen2(seed=5).eval()
    batch = TokenBatch(torch.tensor([[1, 4, 7, 10, 13, 16, 19, 22], [2, 5, 8, 11, 14, 17, 20, 23]]),
                       torch.tensor([[False, False] + [True] * 6, [False] * 3 + [True] * 5]))
    masked = torch.tensor([[False, False, True, False, True, False, True, True],
                           [False, False, False, True, True, False, False, True]])
    with torch.no_grad():
        full = diffusion_logits(model, batch, MASK_TOKEN_ID, 3, masked, shift)  # [batch, seq, vocab]
        kept = diffusion_logits(model, batch, MASK_TOKEN_ID, 3, masked, shift, keep=masked)
        torch.testing.assert_close(kept, full[masked])
        gen = torch.Generator().manual_seed(0)
        parts = diffusion_loss(model, batch, MASK_TOKEN_ID, 3, gen, logits_shift=shift)
        noise = sample_noise(response_blocks(batch, 3), 0.05, torch.Generator().manual_seed(0))
        full = diffusion_logits(model, batch, MASK_TOKEN_ID, 3, noise, shift)
        expected = torch.nn.functional.cross_entropy(full[noise], batch.input_ids[noise])
    torch.testing.assert_close(parts["loss"], expected)


@pytest.mark.slow
@pytest.mark.parametrize("shift,steps,min_rate", [(False, 600, 1.0), (True, 600, 0.9)])
def test_drafter_learns_the_counting_language(shift, steps, min_rate):
    """Every token of the counting language is fixed by its context: a trained block-diffusion
    drafter (the reference adapter, KV-cached, T = 2) must draft the continuation."""
    model = tiny_qwen2(seed=0)
    cfg = TrainConfig(objective="diffusion", block_size=4, lr=3e-3, steps=steps, warmup_steps=10, batch_size=32,
                      seq_len=14, logits_shift=shift)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is several times faster
    try:
        train(model, CountingLanguage(14, prompt_len=2), cfg, mask_token_id=MASK_TOKEN_ID, desc="diffusion")
    finally:
        torch.set_num_threads(threads)
    seqs = CountingLanguage(14).sequences(8, torch.Generator().manual_seed(5))  # [8, 14]
    drafter = DiffusionDrafter(model.eval(), mask_token_id=MASK_TOKEN_ID, gamma=4, steps=2, batch_size=8, pad_id=0,
                               logits_shift=shift)
    for r in range(8):
        drafter.admit(r, seqs[r, :3].tolist())
    draft = drafter.draft([True] * 8).draft_token_ids  # [8, 4]
    assert (draft == seqs[:, 3:7]).float().mean().item() >= min_rate


def test_train_diffusion_recipe_learns_the_targets_continuations(tmp_path):
    """`vllm-prove train diffusion --target`: continuations written by the target, stored and
    fingerprinted; the saved drafter declares its layout and mask id and decodes (strict SDD)."""
    import json

    from vllm_prove.cli import main
    from vllm_prove.zoo import ZOO_DIR

    data = tmp_path / "code.py"
    data.write_text("".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(300)))
    out = tmp_path / "drafter"
    assert main(["train", "diffusion", "--model", str(ZOO_DIR / "verifier"), "--target", str(ZOO_DIR / "proposer"),
                 "--data", str(data), "--out", str(out), "--steps", "21", "--batch-size", "2", "--num-contexts", "8",
                 "--max-new-tokens", "8", "--logits-shift", "--block-size", "4"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["diffusion_drafter"] == {"kind": "block", "logits_shift": True} and cfg["mask_token_id"] == 1
    meta = json.loads((out / "targets" / "meta.json").read_text())
    assert meta["generator"] == str(ZOO_DIR / "proposer") and meta["num_contexts"] == 8
    prompts = tmp_path / "p.txt"
    prompts.write_text("def main():\n")
    assert main(["generate", "--method", "sdd", "--drafter", str(out), "--gamma", "4", "--prompts", str(prompts),
                 "--max-tokens", "8", "--out", str(tmp_path / "o.jsonl")]) == 0
