"""The diffusion drafter adapter (docs/METHODS.md §7): KV-cached drafts equal uncached ones, the
mask is never drafted, start-up checks name what disagrees."""

from __future__ import annotations

import pytest
import torch

from vllm_prove.errors import ProveError
from vllm_prove.reference.drafter import DiffusionDrafter, DrafterKind, check_drafter_tokenizer


def _drafts(model, prompts, shift, use_cache, kind=DrafterKind.BLOCK, rounds=3, gamma=8, steps=2):
    """Draft `rounds` blocks per prompt, committing the first 1 + r % 4 tokens of each."""
    d = DiffusionDrafter(model, mask_token_id=1, gamma=gamma, steps=steps, batch_size=len(prompts), pad_id=0,
                         kind=kind, logits_shift=shift, use_cache=use_cache, features=True)
    for r, p in enumerate(prompts):
        d.admit(r, p)
    out = []
    for i in range(rounds):
        block = d.draft([True] * len(prompts))
        out.append(block)
        d.advance([block.draft_token_ids[r, : 1 + (i + r) % 4].tolist() for r in range(len(prompts))])
    return out


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_cached_drafts_equal_uncached(sdd_models, heldout_prompts, shift, batch):
    tok = sdd_models.tokenizer
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in heldout_prompts[:batch]]
    cached = _drafts(sdd_models.drafter, prompts, shift, True)
    fresh = _drafts(sdd_models.drafter, prompts, shift, False)
    for a, b in zip(cached, fresh):
        assert torch.equal(a.draft_token_ids, b.draft_token_ids)
        assert torch.equal(a.reveal_step, b.reveal_step)
        torch.testing.assert_close(a.confidence, b.confidence, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a.scalars, b.scalars, rtol=1e-4, atol=1e-4)


def test_reveal_steps_follow_the_schedule(sdd_models, heldout_prompts):
    tok = sdd_models.tokenizer
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in heldout_prompts[:4]]
    block = _drafts(sdd_models.drafter, prompts, True, True, gamma=10, steps=3, rounds=1)[0]
    for row in block.reveal_step.tolist():
        assert sorted(row) == [0] * 4 + [1] * 3 + [2] * 3
    # a token revealed early was the more confident one in its pass: raw confidence is its reveal-pass probability
    assert (block.confidence > 0).all() and (block.confidence <= 1).all()


def test_the_mask_token_is_never_drafted(sdd_models, heldout_prompts):
    import copy

    model = copy.deepcopy(sdd_models.drafter)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    tok = sdd_models.tokenizer
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in heldout_prompts[:4]]
    with torch.no_grad():  # point the mask's output row along the mean LM-head input: it wins the argmax
        h = model(input_ids=torch.tensor([prompts[0]]), output_hidden_states=True).hidden_states[-1][0]
        mean = h.mean(0)
        model.lm_head.weight[1] = 100.0 * mean / mean.norm()
    with torch.no_grad():  # the mask really is the argmax almost everywhere without the guard
        h = model(input_ids=torch.tensor([prompts[0]])).logits[0]
    assert (h.argmax(-1) == 1).float().mean() > 0.5
    for block in _drafts(model, prompts, True, True):
        assert not (block.draft_token_ids == 1).any()


def test_full_attention_kind_runs_and_ignores_the_cache(sdd_models, heldout_prompts):
    tok = sdd_models.tokenizer
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in heldout_prompts[:2]]
    a = _drafts(sdd_models.drafter, prompts, True, True, kind=DrafterKind.FULL)
    b = _drafts(sdd_models.drafter, prompts, True, False, kind=DrafterKind.FULL)
    for x, y in zip(a, b):
        assert torch.equal(x.draft_token_ids, y.draft_token_ids)


def test_tokenizer_and_mask_checks_name_both_sides(sdd_models):
    tok = sdd_models.tokenizer
    check_drafter_tokenizer(tok, tok, 1, sdd_models.drafter.config)  # the zoo: one vocabulary, one mask id

    class Config:
        mask_token_id = 7

    with pytest.raises(ProveError, match=r"given = 1, drafter config mask_token_id = 7"):
        check_drafter_tokenizer(tok, tok, 1, Config())

    class Other:
        mask_token_id = 1

        def get_vocab(self):
            vocab = dict(tok.get_vocab())
            vocab["def"], vocab["class"] = vocab["class"], vocab["def"]
            return vocab

        def convert_ids_to_tokens(self, i):
            return tok.convert_ids_to_tokens(i)

    with pytest.raises(ProveError, match=r"token '(def|class)' is id \d+ for the target but \d+ for the drafter"):
        check_drafter_tokenizer(Other(), tok, 1)
