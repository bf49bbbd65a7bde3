"""Verifier fine-tuning data (ProVe §4.1): the proposer's greedy continuations of prompts."""

from __future__ import annotations

import pytest
import torch

from train_tiny import tiny_qwen2
from vllm_prove.train.verifier import proposer_generations, verifier_dataset

EOS = 31


@torch.no_grad()
def _greedy_alone(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference: one prompt, no padding, no KV cache, full forward per token."""
    seq = torch.tensor([prompt])
    out = []
    for _ in range(max_new_tokens):
        nxt = int(model(input_ids=seq).logits[0, -1].argmax())
        out.append(nxt)
        if nxt == EOS:
            break
        seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    return out


def test_train_batched_left_padded_generations_equal_single_prompt_greedy():
    # a wide initialisation gives a random model decisive argmaxes, so padding-free and
    # left-padded batched decoding may not differ by fp32 noise, only by a real bug
    model = tiny_qwen2(seed=3, initializer_range=0.5).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 31, (n,), generator=gen).tolist() for n in (1, 3, 7, 4, 9, 2)]
    got = proposer_generations(model, prompts, max_new_tokens=6, eos_id=EOS, batch_size=4)
    assert [p for p, _ in got] == prompts
    for prompt, response in got:
        assert response == _greedy_alone(model, prompt, 6), prompt


class _Scripted:
    """A proposer whose `generate` appends fixed rows (after the left-padded prompts)."""

    def __init__(self, continuations):
        self.continuations = continuations

    def eval(self):
        return self

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        assert kwargs["do_sample"] is False and kwargs["eos_token_id"] == EOS
        # left padding: the real tokens sit at the right end, flagged by the attention mask
        assert bool((attention_mask.flip(1).cumprod(1) == attention_mask.flip(1)).all())
        tail = torch.tensor(self.continuations[: input_ids.shape[0]])
        return torch.cat([input_ids, tail], dim=1)


def test_train_generations_stop_after_the_first_eos():
    proposer = _Scripted([[5, 6, EOS, EOS], [7, EOS, 8, EOS], [9, 9, 9, 9]])
    got = proposer_generations(proposer, [[1], [2, 3], [4, 4, 4]], max_new_tokens=4, eos_id=EOS)
    assert got == [([1], [5, 6, EOS]), ([2, 3], [7, EOS]), ([4, 4, 4], [9, 9, 9, 9])]


class _Tok:
    eos_token_id = EOS

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [int(c) for c in text.split()]}


def test_train_verifier_dataset_keeps_prompt_tails_and_supervises_generations():
    proposer = _Scripted([[5, EOS, EOS], [6, 7, 8]])
    ds = verifier_dataset(proposer, _Tok(), ["1 2 3 4 5 6", "9"], max_new_tokens=3, seq_len=6)
    assert ds.input_ids.tolist() == [[4, 5, 6, 5, EOS, EOS], [9, 6, 7, 8, EOS, EOS]]
    assert ds.response_mask.int().tolist() == [[0, 0, 0, 1, 1, 0], [0, 1, 1, 1, 0, 0]]


def test_train_verifier_dataset_needs_room_for_a_prompt():
    with pytest.raises(ValueError, match="seq_len"):
        verifier_dataset(_Scripted([[5]]), _Tok(), ["1 2"], max_new_tokens=4, seq_len=4)
