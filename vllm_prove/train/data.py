"""Training data: token streams cut into fixed windows, and prompt/response examples.

A batch is a `TokenBatch`: `input_ids` and `response_mask` (True where a token is a
response token, i.e. a position whose prediction is trained). Plain text has no prompt: every
token is a response token. Prompt/response examples are right-padded with EOS, padding masked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from vllm_prove.errors import ProveError


@dataclass(frozen=True)
class TokenBatch:
    input_ids: torch.Tensor  # [batch, seq] int64
    response_mask: torch.Tensor  # [batch, seq] bool
    valid_mask: torch.Tensor | None = None  # [batch, seq] bool, False on padding; None = all valid


class StreamDataset:
    """Random `seq_len` windows from one long token stream (documents joined by EOS)."""

    def __init__(self, token_ids: torch.Tensor, seq_len: int):
        if token_ids.numel() < seq_len:
            raise ProveError(f"stream of {token_ids.numel()} tokens is shorter than seq_len={seq_len}")
        self.token_ids = token_ids  # [num_tokens]
        self.seq_len = seq_len

    def sample(self, batch_size: int, gen: torch.Generator) -> TokenBatch:
        # every start 0..N-seq_len (randint's high is exclusive): the stream's last token is a target too
        starts = torch.randint(0, self.token_ids.numel() - self.seq_len + 1, (batch_size,), generator=gen)
        idx = starts[:, None] + torch.arange(self.seq_len)[None, :]  # [batch, seq]
        ids = self.token_ids[idx]
        return TokenBatch(ids, torch.ones_like(ids, dtype=torch.bool))


class ExampleDataset:
    """Prompt/response examples, each truncated or right-padded to `seq_len`.

    `group_by_prompt`: a batch holds examples of one prompt length only, cut to its longest row,
    so no compute goes to padding and (MARS) the noisy copy can start at the shared prompt end."""

    def __init__(self, examples: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int,
                 group_by_prompt: bool = False):
        if not examples:
            raise ProveError("no training examples")
        ids = torch.full((len(examples), seq_len), pad_id, dtype=torch.long)
        resp = torch.zeros((len(examples), seq_len), dtype=torch.bool)
        valid = torch.zeros((len(examples), seq_len), dtype=torch.bool)
        for row, (prompt, response) in enumerate(examples):
            seq = (prompt + response)[:seq_len]
            ids[row, : len(seq)] = torch.tensor(seq)
            resp[row, len(prompt) : len(seq)] = True
            valid[row, : len(seq)] = True
        self.input_ids, self.response_mask, self.valid_mask, self.seq_len = ids, resp, valid, seq_len
        lengths = torch.tensor([min(len(prompt), seq_len) for prompt, _ in examples])
        self.groups = [(lengths == n).nonzero().flatten() for n in lengths.unique()] if group_by_prompt else None

    def sample(self, batch_size: int, gen: torch.Generator) -> TokenBatch:
        if self.groups is None:
            rows = torch.randint(0, self.input_ids.shape[0], (batch_size,), generator=gen)
            return TokenBatch(self.input_ids[rows], self.response_mask[rows], self.valid_mask[rows])
        # a group drawn in proportion to its size, then rows from it
        sizes = torch.tensor([len(g) for g in self.groups], dtype=torch.float)
        group = self.groups[int(torch.multinomial(sizes, 1, generator=gen))]
        rows = group[torch.randint(0, len(group), (batch_size,), generator=gen)]
        width = int(self.valid_mask[rows].sum(dim=1).max())
        return TokenBatch(self.input_ids[rows, :width], self.response_mask[rows, :width], self.valid_mask[rows, :width])


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    eos = tokenizer.eos_token_id
    out: list[int] = []
    for text in texts:
        out.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        out.append(eos)
    return torch.tensor(out, dtype=torch.long)


def load_dataset(path: str | Path, tokenizer, seq_len: int):
    """A dataset from a file or folder.

    - `.jsonl` rows with `prompt` and `response` (SFT, prompt tokens unsupervised), or `text`;
    - a `.txt` / `.py` file or a folder of them: plain text, every token supervised.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in {".txt", ".py", ".md"})
        if not files:
            raise ProveError(f"--data folder {path} holds no .txt/.py/.md files")
        return StreamDataset(encode_stream(tokenizer, [p.read_text() for p in files]), seq_len)
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if all("prompt" in r and "response" in r for r in rows):
            enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
            examples = [(enc(r["prompt"]), enc(r["response"]) + [tokenizer.eos_token_id]) for r in rows]
            return ExampleDataset(examples, seq_len, tokenizer.eos_token_id)
        if all("text" in r for r in rows):
            return StreamDataset(encode_stream(tokenizer, [r["text"] for r in rows]), seq_len)
        raise ProveError(f"{path}: every row needs `prompt` and `response`, or `text`")
    return StreamDataset(encode_stream(tokenizer, [path.read_text()]), seq_len)
