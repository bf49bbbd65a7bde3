"""Byte-level BPE tokenizer for the zoo, saved as an HF fast tokenizer (loadable by vLLM)."""

from __future__ import annotations

from pathlib import Path

from vllm_prove.train import MASK_TOKEN  # (the MARS placeholder, defined where it is trained)

# The Qwen2 pre-tokenizer, exactly: transformers >= 5 loads any `model_type: qwen2` checkpoint's
# tokenizer as `Qwen2Tokenizer`, which rebuilds the pipeline with NFC + this split regex +
# byte-level (transformers/models/qwen2/tokenization_qwen2.py). Training with the same pipeline
# makes the tokens the models were trained on the tokens every loader (HF, vLLM) produces.
QWEN2_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                     r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
EOS_TOKEN = "<|endoftext|>"
# A plain-text chat template, so OpenAI chat requests work against the zoo (the models were
# never chat-tuned: this only renders messages as text the base model continues).
CHAT_TEMPLATE = ("{% for message in messages %}# {{ message['role'] }}:\n{{ message['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}# assistant:\n{% endif %}")


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    """Train a byte-level BPE on `texts`; return the `PreTrainedTokenizerFast` saved in `out_dir`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
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
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast
