"""Shared fixtures of tests/train: a tiny Qwen2 and a counting language.

The counting language: `x_k = (s + k * d) mod MODULUS` with a random start `s` and stride
`d in 1..MAX_STRIDE`. Any two consecutive tokens fix `d`, so every later token is fully
determined by the context: a block proposer can be perfect, and its block must then equal its
own greedy AR continuation (docs/METHODS.md §2, "the decisive test").
"""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from vllm_prove.train.data import TokenBatch

MODULUS = 32  # number tokens 0..31
MASK_TOKEN_ID = MODULUS  # the placeholder, one id past the numbers
VOCAB_SIZE = MODULUS + 1
# Strides 1..7 only: with every stride mod 32 the task is full modular arithmetic, which a
# 2-layer model learns only after grokking-length training (600 steps of a 128-wide model on
# mod 64 stayed at chance). Stride 0 is left out so that a block read one place off can
# never match by accident (a constant sequence looks the same at every offset).
MAX_STRIDE = 7


def tiny_qwen2(*, hidden: int = 64, layers: int = 2, seed: int = 0, attn: str = "sdpa",
               attention_dropout: float = 0.0, initializer_range: float = 0.02) -> Qwen2ForCausalLM:
    """A from-scratch Qwen2 over the counting vocabulary (head_dim 32, tied embeddings)."""
    cfg = Qwen2Config(vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=hidden // 32,
                      num_key_value_heads=hidden // 32, head_dim=32, max_position_embeddings=64,
                      rope_theta=10000.0, tie_word_embeddings=True, attention_dropout=attention_dropout,
                      initializer_range=initializer_range, attn_implementation=attn)
    cfg.mask_token_id = MASK_TOKEN_ID
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg)


class CountingLanguage:
    """`sample(batch_size, gen) -> TokenBatch` of counting sequences (the trainer's dataset API).

    The first `prompt_len` tokens are prompt (unsupervised, kept real in the MARS noisy copy);
    the rest is response.
    """

    def __init__(self, seq_len: int, prompt_len: int = 2):
        self.seq_len, self.prompt_len = seq_len, prompt_len

    def sequences(self, batch_size: int, gen: torch.Generator) -> torch.Tensor:
        start = torch.randint(0, MODULUS, (batch_size, 1), generator=gen)  # [batch, 1]
        stride = torch.randint(1, MAX_STRIDE + 1, (batch_size, 1), generator=gen)  # [batch, 1]
        return (start + stride * torch.arange(self.seq_len)) % MODULUS  # [batch, seq]

    def sample(self, batch_size: int, gen: torch.Generator) -> TokenBatch:
        ids = self.sequences(batch_size, gen)  # [batch, seq]
        response_mask = torch.ones_like(ids, dtype=torch.bool)
        response_mask[:, : self.prompt_len] = False
        return TokenBatch(ids, response_mask)
