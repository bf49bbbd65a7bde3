"""Block-diffusion drafter training (docs/METHODS.md §7), for any HF causal LM used as a masked LM.

A block-diffusion drafter reads the committed prefix causally (so the prefix can be KV-cached,
exactly like an AR model) and the draft block bidirectionally. Training reads `2L` tokens, a
clean copy and a noisy copy, both at position ids `0..L-1`; the response (what the drafter must
learn to draft: the target's greedy continuation) is cut into blocks of `gamma` from its start
`c`, and in each block a ratio `r ~ U(min_mask_ratio, 1)` of the tokens is replaced by the mask::

               keys: clean 0..L-1              noisy 0..L-1
    clean q:   causal                          none
    noisy q:   positions before its block      its own block, both directions
               (block k starts at c + k * gamma)

Loss: mean CE over masked tokens. Logit conventions (`logits_shift`):
- MDLM / BERT style (False): the noisy output at `p` predicts the token at `p`;
- Dream / DiffuCoder style (True): the output at `p - 1` predicts `p`; for a block's first token
  that output is the clean copy's (the last committed token at inference, which never sees the
  block), for the others the noisy copy's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_prove.train.data import TokenBatch
from vllm_prove.train.mars import model_attention_mask

NO_BLOCK = -1  # block index of context (non-response) positions


def response_start(batch: TokenBatch) -> torch.Tensor:
    """# [batch] int64: each row's first response position (0 for a row without response)."""
    resp = batch.response_mask  # [batch, seq]
    return torch.where(resp.any(1), resp.float().argmax(1), 0).long()


def response_blocks(batch: TokenBatch, gamma: int) -> torch.Tensor:
    """# [batch, seq] int64: block index of each response token, counted from the row's
    response start; NO_BLOCK on context and padding."""
    pos = torch.arange(batch.response_mask.shape[1])[None, :]  # [1, seq]
    return torch.where(batch.response_mask, (pos - response_start(batch)[:, None]) // gamma, NO_BLOCK)


def diffusion_attention_mask(blocks: torch.Tensor, gamma_start: torch.Tensor) -> torch.Tensor:
    """# [batch, 2 * seq, 2 * seq] bool (True = may attend) from `blocks` # [batch, seq] and each
    position's block start `gamma_start` # [batch, seq] (first position of its block; for
    context positions the position itself)."""
    bsz, seq = blocks.shape
    pos = torch.arange(seq)
    causal = (pos[:, None] >= pos[None, :]).expand(bsz, seq, seq)  # [batch, seq, seq]
    in_block = blocks != NO_BLOCK  # [batch, seq]
    before_block = pos[None, None, :] < gamma_start[:, :, None]  # [batch, seq(q), seq(k)]
    same_block = (blocks[:, :, None] == blocks[:, None, :]) & in_block[:, :, None]  # [batch, seq, seq]
    # noisy context positions carry no loss; they read the clean copy causally (no empty rows)
    noisy_clean = torch.where(in_block[:, :, None], before_block, causal)
    noisy_noisy = same_block | (~in_block[:, :, None] & torch.eye(seq, dtype=torch.bool)[None])
    top = torch.cat([causal, torch.zeros_like(causal)], dim=2)
    bottom = torch.cat([noisy_clean, noisy_noisy], dim=2)
    return torch.cat([top, bottom], dim=1)


def sample_noise(blocks: torch.Tensor, min_mask_ratio: float, gen: torch.Generator) -> torch.Tensor:
    """# [batch, seq] bool: which response tokens the noisy copy masks. Each (row, block) draws
    its ratio r ~ U(min_mask_ratio, 1), each token is masked with probability r, and every block
    keeps at least one mask (its most-likely-masked token) so each block carries loss."""
    bsz, seq = blocks.shape
    num_blocks = int(blocks.max()) + 1 if bool((blocks >= 0).any()) else 0
    ratio = min_mask_ratio + (1 - min_mask_ratio) * torch.rand(bsz, max(1, num_blocks), generator=gen)
    u = torch.rand(bsz, seq, generator=gen)  # [batch, seq]
    idx = blocks.clamp(min=0)
    masked = (u < ratio.gather(1, idx)) & (blocks != NO_BLOCK)
    # force the smallest-u token of every block: scatter-reduce the minimum u per (row, block)
    u_in = torch.where(blocks != NO_BLOCK, u, 2.0)
    block_min = torch.full((bsz, max(1, num_blocks)), 2.0).scatter_reduce(1, idx, u_in, "amin")
    return masked | ((u_in == block_min.gather(1, idx)) & (blocks != NO_BLOCK))


def diffusion_logits(model, batch: TokenBatch, mask_token_id: int, gamma: int, masked: torch.Tensor,
                     logits_shift: bool = False, keep: torch.Tensor | None = None) -> torch.Tensor:
    """# [batch, seq, vocab]: the drafter's prediction for each position's token, given the noisy
    copy that masks `masked` # [batch, seq] (layout and conventions in the module docstring).
    With `keep` # [batch, seq] bool: # [kept, vocab], the predictions at those positions only (the
    output layer is a drafter's largest matmul where the vocabulary is large)."""
    ids = batch.input_ids  # [batch, seq]
    bsz, seq = ids.shape
    blocks = response_blocks(batch, gamma)  # [batch, seq]
    pos = torch.arange(seq)[None, :]
    gamma_start = torch.where(blocks != NO_BLOCK, response_start(batch)[:, None] + blocks * gamma, pos)  # [batch, seq]
    noisy = torch.where(masked, torch.full_like(ids, mask_token_id), ids)
    allowed = diffusion_attention_mask(blocks, gamma_start)  # [batch, 2 * seq, 2 * seq]
    positions = torch.cat([torch.arange(seq), torch.arange(seq)])[None].expand(bsz, -1)
    hidden = model.get_decoder()(input_ids=torch.cat([ids, noisy], dim=1), position_ids=positions,
                                 attention_mask=model_attention_mask(model, allowed[:, None])).last_hidden_state
    clean, out = hidden[:, :seq], hidden[:, seq:]  # [batch, seq, hidden] each
    if logits_shift:
        # the output at p - 1 predicts p: the clean copy's at a block start, else the noisy copy's
        first = (pos == gamma_start)[..., None]  # [batch, seq, 1]
        prev = lambda x: torch.cat([x[:, :1], x[:, :-1]], dim=1)  # noqa: E731  x[p - 1] at p
        out = torch.where(first, prev(clean), prev(out))
    return model.get_output_embeddings()(out if keep is None else out[keep])


def diffusion_loss(model, batch: TokenBatch, mask_token_id: int, gamma: int, gen: torch.Generator,
                   min_mask_ratio: float = 0.05, logits_shift: bool = False) -> dict:
    """Mean CE of the masked response tokens."""
    ids = batch.input_ids  # [batch, seq]
    masked = sample_noise(response_blocks(batch, gamma), min_mask_ratio, gen)  # [batch, seq]
    pred = diffusion_logits(model, batch, mask_token_id, gamma, masked, logits_shift, keep=masked)  # [masked, vocab]
    loss = F.cross_entropy(pred.float(), ids[masked]) if bool(masked.any()) else pred.sum() * 0.0
    return {"loss": loss, "masked_ce": loss.detach(),
            "mask_ratio": masked.sum() / batch.response_mask.sum().clamp(min=1)}
