"""Byte-level BPE tokenizer for the zoo, saved as an HF fast tokenizer (loadable by vLLM)."""

from __future__ import annotations

from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"  # the MARS placeholder; its id goes to config.json as `mask_token_id`


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    """Train a byte-level BPE on `texts`; return the `PreTrainedTokenizerFast` saved in `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, MASK_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        mask_token=MASK_TOKEN,
        model_max_length=2048,
    )
    fast.save_pretrained(out_dir)
    return fast
