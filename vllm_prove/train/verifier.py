"""Verifier fine-tuning on proposer generations (ProVe paper §4.1).

The verifier scores the proposer's blocks, so it is trained on what the proposer writes: the
proposer continues training prompts greedily, and the verifier learns those continuations with
the ordinary AR objective (prompt tokens unsupervised).
"""

from __future__ import annotations

import torch

from vllm_prove.train.data import ExampleDataset
from vllm_prove.errors import ProveError


@torch.no_grad()
def proposer_generations(proposer, prompt_ids: list[list[int]], max_new_tokens: int, eos_id: int,
                         batch_size: int = 16) -> list[tuple[list[int], list[int]]]:
    """Greedy continuations `(prompt, response)` of each prompt (left-padded batches, KV cache)."""
    examples = []
    proposer.eval()
    for i in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[i : i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), eos_id, dtype=torch.long)
        attn = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, p in enumerate(chunk):
            ids[row, width - len(p):] = torch.tensor(p)
            attn[row, width - len(p):] = 1
        out = proposer.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=eos_id, eos_token_id=eos_id)
        for row, p in enumerate(chunk):
            resp = out[row, width:].tolist()
            if eos_id in resp:
                resp = resp[: resp.index(eos_id) + 1]
            examples.append((p, resp))
    return examples


def verifier_dataset(proposer, tokenizer, prompts: list[str], max_new_tokens: int, seq_len: int) -> ExampleDataset:
    if seq_len <= max_new_tokens:  # else `[-0:]` below keeps whole prompts and truncation eats the responses
        raise ProveError(f"seq_len ({seq_len}) must exceed max_new_tokens ({max_new_tokens}) to leave room "
                         f"for a prompt")
    enc = [tokenizer(p, add_special_tokens=False)["input_ids"][-(seq_len - max_new_tokens):] for p in prompts]
    examples = proposer_generations(proposer, enc, max_new_tokens, tokenizer.eos_token_id)
    return ExampleDataset(examples, seq_len, tokenizer.eos_token_id)
