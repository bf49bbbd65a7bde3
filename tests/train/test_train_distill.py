"""Self-distillation: targets are the model's own greedy output, stored resumably with their
generator, and MARS trained on them makes the block match the model's greedy continuation."""

from __future__ import annotations

import json

import pytest
import torch

from train_tiny import MASK_TOKEN_ID, MODULUS, tiny_qwen2
from vllm_prove.config import TrainConfig
from vllm_prove.train.data import StreamDataset, TokenBatch
from vllm_prove.train.distill import (build_targets, distill_dataset, fingerprint, greedy_agreement,
                                      greedy_continuations, sample_contexts, self_distill_mars)
from vllm_prove.train.mars import mars_loss, shifted_kl
from vllm_prove.zoo.evaluate import block_match

EOS = 0  # a number token stands in for EOS: the counting vocabulary has none


def _stream(n: int = 4000, seed: int = 0) -> StreamDataset:
    gen = torch.Generator().manual_seed(seed)
    return StreamDataset(torch.randint(0, MODULUS, (n,), generator=gen), 64)


def _one_by_one(model, contexts, max_new):
    out = []
    for c in contexts:
        ids = torch.tensor([c])
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, pad_token_id=EOS, eos_token_id=EOS)[0, len(c):].tolist()
        out.append(gen[: gen.index(EOS) + 1] if EOS in gen else gen)
    return out


def test_greedy_continuations_are_what_the_model_writes_alone():
    model = tiny_qwen2(seed=3).eval()
    contexts = sample_contexts(_stream(), 21, seed=1, buckets=(5, 9, 12))
    assert sorted({len(c) for c in contexts}) == [5, 9, 12]
    got = greedy_continuations(model, contexts, 10, EOS, batch_size=4)
    assert got == _one_by_one(model, contexts, 10)


def test_targets_resume_shard_by_shard_and_refuse_another_generator(tmp_path):
    model = tiny_qwen2(seed=3).eval()
    kw = dict(num_contexts=10, max_new_tokens=6, eos_id=EOS, seed=2, shard_size=4, generator_name="tiny")
    first = build_targets(model, _stream(), tmp_path, **kw)
    shards = sorted(tmp_path.glob("shard-*.json"))
    assert len(shards) == 3 and json.loads((tmp_path / "meta.json").read_text())["fingerprint"] == fingerprint(model)
    assert [r for _, r in first] == greedy_continuations(model, [c for c, _ in first], 6, EOS)
    shards[1].unlink()  # an interrupted run: the missing shard is regenerated, the others reused
    stale = json.loads(shards[0].read_text())
    stale[0][1] = [7, 7, 7]
    shards[0].write_text(json.dumps(stale))
    again = build_targets(model, _stream(), tmp_path, **kw)
    assert again[0][1] == [7, 7, 7]  # read back, not regenerated
    assert again[4:8] == first[4:8] and shards[1].exists()
    with pytest.raises(ValueError, match="fingerprint"):
        build_targets(tiny_qwen2(seed=4), _stream(), tmp_path, **kw)
    with pytest.raises(ValueError, match="max_new_tokens"):
        build_targets(model, _stream(), tmp_path, **{**kw, "max_new_tokens": 7})


def test_fingerprint_changes_with_any_weight():
    model = tiny_qwen2(seed=3)
    before = fingerprint(model)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] += 1.0
    assert fingerprint(model) != before


def test_distill_dataset_supervises_only_the_continuation():
    ds = distill_dataset([([1, 2, 3], [4, 5]), ([6], [7, 8, 9, 10])], pad_id=EOS)
    assert ds.seq_len == 5
    assert ds.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    assert ds.response_mask.tolist() == [[False, False, False, True, True], [False, True, True, True, True]]


def test_soft_block_loss_is_kl_to_the_teacher():
    torch.manual_seed(0)
    ids = torch.randint(0, MODULUS, (2, 8))
    resp = torch.ones_like(ids, dtype=torch.bool)
    resp[:, :3] = False
    batch = TokenBatch(ids, resp)
    logits = torch.randn(2, 8, MODULUS + 1)
    assert shifted_kl(logits, logits, batch).abs() < 1e-6
    assert shifted_kl(logits, torch.randn_like(logits), batch) > 0.01
    other = logits.clone()
    other[:, :2] = torch.randn(2, 2, MODULUS + 1)  # logits at 0..1 predict prompt tokens: not supervised
    assert shifted_kl(other, logits, batch).abs() < 1e-6
    model = tiny_qwen2(seed=1)
    teacher = torch.randn(2, 8, MODULUS + 1)
    hard = mars_loss(model, batch, MASK_TOKEN_ID, 4, teacher_logits=teacher, soft_weight=0.0)
    soft = mars_loss(model, batch, MASK_TOKEN_ID, 4, teacher_logits=teacher, soft_weight=1.0)
    assert "kl" not in hard and torch.allclose(soft["loss"], soft["kl"] + soft["ar"])
    assert torch.allclose(hard["loss"], hard["block"] + hard["ar"])


def test_block_size_mix_is_validated():
    with pytest.raises(ValueError, match="block_size_mix"):
        TrainConfig(block_size_mix=(8, 1))


@pytest.mark.slow
def test_self_distilled_mars_makes_the_block_match_the_models_greedy_output(tmp_path):
    """A random model's greedy output is a deterministic function of its context, so a block
    proposer trained on it can learn it; corpus-free, only the model's own continuations."""
    model = tiny_qwen2(seed=5, hidden=64).eval()
    stream = _stream(20000, seed=3)
    windows = stream.sample(64, torch.Generator().manual_seed(9)).input_ids[:, :12]
    before = block_match(model, windows, 4, MASK_TOKEN_ID)["prefix"]
    teacher = tiny_qwen2(seed=5, hidden=64).eval()
    cfg = TrainConfig(objective="mars", block_size=4, lr=3e-3, warmup_steps=5, steps=80, batch_size=16,
                      checkpoint_every=30, seed=0)
    logs = self_distill_mars(model, stream, cfg, work_dir=tmp_path, mask_token_id=MASK_TOKEN_ID, eos_id=EOS,
                             rounds=2, num_contexts=256, max_new_tokens=12)
    after = block_match(model, windows, 4, MASK_TOKEN_ID)["prefix"]
    assert [log["round"] for log in logs] == [0, 1] and (tmp_path / "round-1" / "targets" / "meta.json").exists()
    assert after >= before + 1.0, (before, after)
    agree = greedy_agreement(teacher, model, windows[:16].tolist(), 8, EOS)
    assert 0.0 <= agree["common_prefix_share"] <= 1.0 and agree["num_contexts"] == 16


def test_teacher_anchor_is_kl_to_the_teacher_everywhere_but_padding():
    torch.manual_seed(0)
    ids = torch.randint(0, MODULUS, (2, 8))
    resp = torch.zeros_like(ids, dtype=torch.bool)
    resp[:, 3:6] = True
    valid = torch.ones_like(resp)
    valid[:, 6:] = False  # right padding
    batch = TokenBatch(ids, resp, valid)
    logits, teacher = torch.randn(2, 8, MODULUS + 1), torch.randn(2, 8, MODULUS + 1)
    context_only = logits.clone()
    context_only[:, :2] = teacher[:, :2]  # positions 0..1 predict context tokens 1..2
    # everywhere=True reads context targets; the response-only KL does not
    assert shifted_kl(context_only, teacher, batch, everywhere=True) < shifted_kl(logits, teacher, batch, everywhere=True)
    assert shifted_kl(context_only, teacher, batch) == pytest.approx(shifted_kl(logits, teacher, batch).item())
    padded = logits.clone()
    padded[:, 5:] = torch.randn(2, 3, MODULUS + 1)  # logits at 5..7 predict padding 6..8: never read
    assert shifted_kl(padded, teacher, batch, everywhere=True) == pytest.approx(
        shifted_kl(logits, teacher, batch, everywhere=True).item())
    model = tiny_qwen2(seed=1)
    with torch.no_grad():
        own = model(input_ids=ids).logits
    parts = mars_loss(model, batch, MASK_TOKEN_ID, 4, teacher_logits=own, anchor="teacher")
    assert parts["ar"].abs() < 1e-5  # the clean copy is the teacher: nothing to pull back
    assert torch.allclose(parts["loss"], parts["block"] + parts["ar"])
    with pytest.raises(ValueError, match="anchor 'teacher' needs the teacher's logits"):
        mars_loss(model, batch, MASK_TOKEN_ID, 4, anchor="teacher")


def test_teacher_anchor_keeps_the_generator_fixed_and_self_refreshes_it(tmp_path):
    stream = _stream(6000, seed=4)
    cfg = TrainConfig(objective="mars", block_size=4, lr=3e-3, warmup_steps=2, steps=6, batch_size=8,
                      checkpoint_every=100, seed=0)
    fingerprints = {}
    for anchor in ("teacher", "self"):
        model = tiny_qwen2(seed=5, hidden=64).eval()
        self_distill_mars(model, stream, cfg.model_copy(update={"anchor": anchor}), work_dir=tmp_path / anchor,
                          mask_token_id=MASK_TOKEN_ID, eos_id=EOS, rounds=2, num_contexts=16, max_new_tokens=6)
        metas = [json.loads((tmp_path / anchor / f"round-{r}" / "targets" / "meta.json").read_text()) for r in (0, 1)]
        fingerprints[anchor] = [m["fingerprint"] for m in metas]
        assert [m["generator"] for m in metas] == (["model@teacher"] * 2 if anchor == "teacher"
                                                   else ["model@round0", "model@round1"])
    assert fingerprints["teacher"][0] == fingerprints["teacher"][1] == fingerprints["self"][0]
    assert fingerprints["self"][1] != fingerprints["self"][0]  # self: round 1 was written by the trained model
    with pytest.raises(ValueError, match="anchor 'teacher' need"):
        from vllm_prove.train.trainer import train

        train(tiny_qwen2(seed=1), stream, cfg.model_copy(update={"anchor": "teacher"}), mask_token_id=MASK_TOKEN_ID)
