"""The batched KV cache: dead slots are invisible, compaction changes nothing, rows are independent."""

from __future__ import annotations

import torch

from vllm_prove.reference.kv import BatchedKV


def _fresh_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()  # [seq, vocab]


def test_dead_slots_and_padding_are_invisible(zoo_models):
    model = zoo_models.proposer
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(5, 4000, (12,), generator=gen).tolist()
    b = torch.randint(5, 4000, (7,), generator=gen).tolist()
    kv = BatchedKV(model, batch_size=2)
    # row 0 reads a[:5] + 3 junk tokens but keeps 5; row 1 reads b[:3] (padded) and keeps 3
    ids = torch.tensor([a[:5] + [1, 1, 1], b[:3] + [0] * 5])
    kv.extend(ids, torch.tensor([8, 3]))
    kv.commit(torch.tensor([5, 3]))
    logits = kv.extend(torch.tensor([a[5:12], b[3:7] + [0, 0, 0]]), torch.tensor([7, 4]))  # [2, 7, vocab]
    ref_a, ref_b = _fresh_logits(model, a), _fresh_logits(model, b)
    torch.testing.assert_close(logits[0], ref_a[5:12], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1, :4], ref_b[3:7], atol=2e-5, rtol=1e-5)
    assert torch.equal(logits[0].argmax(-1), ref_a[5:12].argmax(-1))


def test_compaction_preserves_outputs(zoo_models):
    model = zoo_models.proposer
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(5, 4000, (30,), generator=gen).tolist() for _ in range(3)]
    kv = BatchedKV(model, batch_size=3)
    for step in range(0, 24, 4):  # read 4 + 4 junk, keep 4 (rows keep different counts)
        chunk = torch.tensor([s[step:step + 4] + [2] * 4 for s in seqs])
        kv.extend(chunk, torch.tensor([8, 8, 8]))
        kv.commit(torch.tensor([4, 4, 4]))
    width_before = kv.state.shape[1]
    kv.compact()
    assert kv.state.shape[1] == 24 < width_before
    logits = kv.extend(torch.tensor([s[24:30] for s in seqs]), torch.tensor([6, 6, 6]))
    for r, s in enumerate(seqs):
        torch.testing.assert_close(logits[r], _fresh_logits(model, s)[24:30], atol=2e-5, rtol=1e-5)


def test_commit_more_than_read_is_rejected(zoo_models):
    kv = BatchedKV(zoo_models.proposer, batch_size=1)
    kv.extend(torch.tensor([[5, 6]]), torch.tensor([2]))
    try:
        kv.commit(torch.tensor([3]))
    except ValueError as err:
        assert "exceeds tentative" in str(err)
    else:
        raise AssertionError("commit past the tentative tokens must fail")
