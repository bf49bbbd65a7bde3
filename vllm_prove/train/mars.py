"""The MARS block-training objective (docs/METHODS.md §2), for any HF causal LM.

The model reads `2L` tokens: a clean copy of the sequence and a noisy copy in which every
response token is the mask token. Both copies use position ids `0..L-1`. Attention:

               keys: clean 0..L-1          noisy 0..L-1
    clean q:   causal                      none
    noisy q:   blocks strictly before      causal, same block only

with block index = position // B from the sequence start. Labels are right-shifted (the logit
at `i` predicts the token at `i+1`), response tokens only, and
`loss = CE(noisy logits) + ar_weight * CE(clean logits)`.

At inference (docs/METHODS.md §1) the context ends at `t`, masks sit at `t+1..t+B-1`; the output
at mask `t+j` predicts the token `j+1` places after `t`: in training a noisy query sees
`n` masks of its block (itself included) and predicts the token `n+1` places after the last
clean token it sees, so the two layouts agree whatever `t` is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_prove.train.data import TokenBatch
from vllm_prove.errors import ProveError


def mars_attention_mask(seq_len: int, block_size: int) -> torch.Tensor:
    """# [2 * seq, 2 * seq] bool, True = may attend. Rows/cols: clean copy, then noisy copy."""
    pos = torch.arange(seq_len)
    blk = pos // block_size
    causal = pos[:, None] >= pos[None, :]  # [seq, seq]
    same_block = blk[:, None] == blk[None, :]
    earlier_block = blk[:, None] > blk[None, :]
    top = torch.cat([causal, torch.zeros_like(causal)], dim=1)
    bottom = torch.cat([earlier_block, causal & same_block], dim=1)
    return torch.cat([top, bottom], dim=0)


def mars_inputs(batch: TokenBatch, mask_token_id: int, block_size: int, noisy_from: int = 0) -> dict:
    """Model kwargs for the MARS input: the clean copy, then the noisy copy from position
    `noisy_from` on (a multiple of `block_size`; 0 = the whole `2L` layout). Noisy rows of earlier
    blocks reach no later noisy row (noisy->noisy stays inside a block), so leaving them out
    changes no output from `noisy_from` on: `noisy_start` says how much of a batch can go."""
    ids = batch.input_ids  # [batch, seq]
    bsz, seq_len = ids.shape
    if noisy_from % block_size or not 0 <= noisy_from < seq_len:
        raise ProveError(f"noisy_from={noisy_from} must be a multiple of block_size={block_size} below {seq_len}")
    noisy = torch.where(batch.response_mask, torch.full_like(ids, mask_token_id), ids)[:, noisy_from:]
    pos = torch.arange(seq_len, device=ids.device)
    keep = torch.cat([pos, seq_len + pos[noisy_from:]])  # rows/cols of the full layout kept
    attn = mars_attention_mask(seq_len, block_size).to(ids.device)[keep][:, keep]
    return {
        "input_ids": torch.cat([ids, noisy], dim=1),  # [batch, seq + noisy]
        "position_ids": torch.cat([pos, pos[noisy_from:]])[None].expand(bsz, -1),  # [batch, seq + noisy]
        "attention_mask": attn[None, None].expand(bsz, 1, -1, -1),  # [batch, 1, seq + noisy, seq + noisy]
    }


def noisy_start(batch: TokenBatch, block_size: int) -> int:
    """First block of the noisy copy with a supervised output: the block of the position before
    the batch's first response token (its output predicts that token)."""
    rows = batch.response_mask[:, 1:].any(dim=0).nonzero()
    first_output = int(rows[0]) if rows.numel() else 0  # output at i predicts i + 1
    return first_output // block_size * block_size


def _suffix(batch: TokenBatch, start: int) -> TokenBatch:
    valid = batch.valid_mask[:, start:] if batch.valid_mask is not None else None
    return TokenBatch(batch.input_ids[:, start:], batch.response_mask[:, start:], valid)


def shifted_ce(logits: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """Mean CE of `logits[:, i]` against token `i+1`, over response targets only."""
    # logits: [batch, seq, vocab]
    target = batch.input_ids[:, 1:]  # [batch, seq - 1]
    weight = batch.response_mask[:, 1:].float()
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), target.flatten(), reduction="none")
    return (ce * weight.flatten()).sum() / weight.sum().clamp(min=1.0)


def ar_loss(model, batch: TokenBatch) -> dict:
    logits = model(input_ids=batch.input_ids).logits  # [batch, seq, vocab]
    loss = shifted_ce(logits, batch)
    return {"loss": loss, "ar": loss.detach()}


def model_attention_mask(model, allowed: torch.Tensor) -> torch.Tensor:
    """The 4D `allowed` mask (True = may attend) in the form `model`'s attention reads.

    HF passes a 4D mask to the attention function untouched: SDPA reads a bool mask as
    "True = attend", but eager attention *adds* the mask to the scores, so a bool mask there
    adds 1/0 and masks nothing (the clean copy would silently read the noisy one). Other
    implementations (flash-attention) cannot take an arbitrary 4D mask at all.
    """
    # allowed: [batch, 1, 2 * seq, 2 * seq] bool; returns the same shape, bool or model dtype
    impl = getattr(model.config, "_attn_implementation", None)
    if impl == "sdpa":
        return allowed
    if impl == "eager":
        dtype = model.dtype
        additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return additive.masked_fill(~allowed, torch.finfo(dtype).min)
    raise ProveError(f"MARS training needs attn_implementation 'sdpa' or 'eager' (a custom 4D attention "
                     f"mask); the model uses {impl!r}")


def shifted_kl(logits: torch.Tensor, teacher_logits: torch.Tensor, batch: TokenBatch,
               everywhere: bool = False) -> torch.Tensor:
    """Mean KL(teacher || student) of the next-token distributions at `i` (predicting `i+1`),
    over response targets (the soft version of `shifted_ce` against the teacher's argmax), or
    with `everywhere` over every non-padding target, context included."""
    # logits, teacher_logits: [batch, seq, vocab]
    if everywhere:
        valid = batch.valid_mask if batch.valid_mask is not None else torch.ones_like(batch.response_mask)
        weight = valid[:, 1:].float()  # [batch, seq - 1]
    else:
        weight = batch.response_mask[:, 1:].float()  # [batch, seq - 1]
    log_q = F.log_softmax(logits[:, :-1].float(), dim=-1)
    log_p = F.log_softmax(teacher_logits[:, :-1].float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [batch, seq - 1]
    return (kl * weight).sum() / weight.sum().clamp(min=1.0)


def mars_loss(model, batch: TokenBatch, mask_token_id: int, block_size: int, ar_weight: float = 1.0,
              teacher_logits: torch.Tensor | None = None, soft_weight: float = 0.0, anchor: str = "self") -> dict:
    """MARS loss. Self-distillation passes `teacher_logits` (the generating model's clean-copy
    logits on the same sequence):
    - `soft_weight` mixes KL to the teacher's next-token distribution into the block term (the
      masks learn the teacher's whole distribution, not only its argmax);
    - `anchor="teacher"` replaces the clean-copy CE on the targets by KL to the teacher at every
      position, context included: the AR behaviour stays the teacher's (its greedy output and its
      likelihood of real text) instead of sharpening onto its own argmax round after round."""
    seq_len = batch.input_ids.shape[1]
    start = noisy_start(batch, block_size)
    inputs = mars_inputs(batch, mask_token_id, block_size, noisy_from=start)
    inputs["attention_mask"] = model_attention_mask(model, inputs["attention_mask"])
    # logits only where a loss reads them: the clean copy (from the first target's predecessor
    # unless the anchor reads every position) and the kept noisy copy; the vocabulary projection
    # of a real checkpoint costs as much as its layers
    clean_from = 0 if anchor == "teacher" else start
    keep = torch.cat([torch.arange(clean_from, seq_len), torch.arange(seq_len, inputs["input_ids"].shape[1])])
    logits = model(**inputs, logits_to_keep=keep.to(batch.input_ids.device)).logits  # [batch, keep, vocab]
    clean, noisy = logits[:, : seq_len - clean_from], logits[:, seq_len - clean_from :]
    if anchor == "teacher":
        if teacher_logits is None:
            raise ProveError("anchor 'teacher' needs the teacher's logits (self-distillation)")
        ar = shifted_kl(clean, teacher_logits, batch, everywhere=True)
    else:
        ar = shifted_ce(clean, _suffix(batch, clean_from))
    tail = _suffix(batch, start)
    block = shifted_ce(noisy, tail)
    parts = {"ar": ar.detach(), "block": block.detach()}
    if teacher_logits is not None and soft_weight > 0:
        kl = shifted_kl(noisy, teacher_logits[:, start:], tail)
        block = (1 - soft_weight) * block + soft_weight * kl
        parts["kl"] = kl.detach()
    return {"loss": block + ar_weight * ar, **parts}
