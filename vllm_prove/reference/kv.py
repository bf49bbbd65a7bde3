"""A batched KV cache whose rows advance at their own pace, over any HF causal LM.

Speculative decoders write tokens into the cache that they may later throw away (mask
placeholders, rejected drafts), and each row keeps a different number. Instead of cropping
(impossible per row in a rectangular cache) every slot carries a state:

    slot:    0    1    2    3    4    5    6    7
    row 0: [ p0 | p1 | p2 | y1 | m  | m  | -- | -- ]   VALID VALID VALID TENTATIVE ... DEAD
    row 1: [ -- | q0 | q1 | y1 | y2 | m  | m  | -- ]   (DEAD slots are never attended again)

`extend()` appends one slot per input column to every row; real columns become TENTATIVE
(visible to later `extend()` calls, e.g. serial drafting), padding columns DEAD. `commit(n)`
keeps the first `n` tentative tokens of each row as VALID and kills the rest. Attention masks
and position ids are built from the slot states, so a row's tokens always sit at contiguous
logical positions. `compact()` drops dead slots when they pile up. Attention uses an explicit
boolean 4D mask (sdpa): a masked key contributes exactly zero.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

DEAD, VALID, TENTATIVE = 0, 1, 2  # slot states


class BatchedKV:
    def __init__(self, model, batch_size: int):
        self.model = model
        self.batch_size = batch_size
        self.device = next(model.parameters()).device
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.state = torch.zeros(self.batch_size, 0, dtype=torch.int8)  # [batch, slots]
        self.order = torch.zeros(self.batch_size, 0, dtype=torch.long)  # [batch, slots] rank among tentative
        self.pos = torch.zeros(self.batch_size, dtype=torch.long)  # [batch] next committed position
        self.num_tentative = torch.zeros(self.batch_size, dtype=torch.long)  # [batch]
        self.passes = 0  # forward passes run
        self.rows = 0  # sum over passes of rows with at least one real token

    def reset_rows(self, rows: list[int]) -> None:
        """Forget rows (a finished request leaves, a new one takes its place)."""
        self.state[rows] = DEAD
        self.pos[rows] = 0
        self.num_tentative[rows] = 0

    @torch.no_grad()
    def extend(self, input_ids: torch.Tensor, lengths: torch.Tensor, bidirectional_from: torch.Tensor | None = None,
               output_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run the model on right-padded `input_ids` # [batch, n] with `lengths` # [batch] real
        tokens per row; return logits # [batch, n, vocab] (padding columns are garbage).

        `bidirectional_from` # [batch]: columns from there to the row's end attend to each other
        in both directions (a block-diffusion draft block); earlier columns stay causal.
        `output_hidden`: also return the last layer's output (the LM head's input) # [batch, n, hidden]."""
        bsz, n = input_ids.shape
        col = torch.arange(n)
        real = col[None, :] < lengths[:, None]  # [batch, n]
        position_ids = self.pos[:, None] + self.num_tentative[:, None] + col[None, :]  # [batch, n]
        visible_old = self.state != DEAD  # [batch, slots]
        causal = (col[None, :, None] >= col[None, None, :]).expand(bsz, n, n)  # [batch, n, n]
        if bidirectional_from is not None:
            seg = (col[None, :] >= bidirectional_from[:, None]) & real  # [batch, n]
            causal = causal | (seg[:, :, None] & seg[:, None, :])
        mask = torch.cat([visible_old[:, None, :].expand(bsz, n, -1), causal], dim=2)
        out = self.model(input_ids=input_ids.to(self.device), position_ids=position_ids.to(self.device),
                         attention_mask=mask[:, None].to(self.device), past_key_values=self.cache, use_cache=True,
                         output_hidden_states=output_hidden)
        self.cache = out.past_key_values
        new_state = torch.where(real, TENTATIVE, DEAD).to(torch.int8)
        self.state = torch.cat([self.state, new_state], dim=1)
        self.order = torch.cat([self.order, self.num_tentative[:, None] + col[None, :]], dim=1)
        self.num_tentative += lengths
        self.passes += 1
        self.rows += int((lengths > 0).sum())
        if output_hidden:
            return out.logits.float(), out.hidden_states[-1].float()
        return out.logits.float()

    def commit(self, num_keep: torch.Tensor) -> None:
        """Keep the first `num_keep` # [batch] tentative tokens of each row; kill the rest."""
        if bool((num_keep > self.num_tentative).any()):
            raise ValueError(f"commit {num_keep.tolist()} exceeds tentative {self.num_tentative.tolist()}")
        tentative = self.state == TENTATIVE
        keep = tentative & (self.order < num_keep[:, None])
        self.state = torch.where(keep, VALID, torch.where(tentative, DEAD, self.state)).to(torch.int8)
        self.pos += num_keep
        self.num_tentative.zero_()
        if self.state.shape[1] > 256 and self.state.shape[1] > 2 * int((self.state == VALID).sum(1).max()):
            self.compact()

    def discard(self) -> None:
        """Throw away every tentative slot (a diagnostic pass that must leave no trace)."""
        self.commit(torch.zeros(self.batch_size, dtype=torch.long))

    def compact(self) -> None:
        """Drop dead slots: each row's valid slots move right-aligned into the shortest width."""
        valid = self.state == VALID  # [batch, slots]
        width = int(valid.sum(1).max())
        # stable sort puts dead slots first, valid slots last, keeping order within each group
        idx = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices[:, -width:] if width else \
            torch.zeros(self.batch_size, 0, dtype=torch.long)
        self.state = torch.gather(self.state, 1, idx)
        self.order = torch.zeros_like(idx)
        gather = idx.to(self.device)
        for layer in self.cache.layers:
            g = gather[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = torch.gather(layer.keys, 2, g)
            layer.values = torch.gather(layer.values, 2, g)


def pad_rows(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists: (# [batch, n] int64, lengths # [batch] int64)."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    width = max(1, int(lengths.max()) if len(rows) else 1)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return ids, lengths
