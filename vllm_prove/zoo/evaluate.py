"""Held-out diagnostics recorded in the zoo manifest."""

from __future__ import annotations

import torch


@torch.no_grad()
def block_match(model, windows: torch.Tensor, block_size: int, mask_token_id: int,
                greedy: torch.Tensor | None = None) -> dict:
    """How far the proposed block agrees with the model's own greedy AR continuation.

    `windows` # [batch, seq]: contexts. The block comes from one pass over
    `context + (B-1) masks` (docs/METHODS.md, "one-pass block proposal"); the reference is B
    greedy AR steps. Returns `rate` (per position, the share of blocks equal to greedy there)
    and `prefix` (mean length of the AR-matching prefix: what lossless decoding can commit
    before its bonus token; position 1 is the ordinary next-token prediction). `greedy`
    # [batch, >= B]: the model's greedy continuations, when already known.
    """
    bsz, t = windows.shape
    masks = torch.full((bsz, block_size - 1), mask_token_id, dtype=torch.long)
    logits = model(input_ids=torch.cat([windows, masks], dim=1)).logits  # [batch, seq + B - 1, vocab]
    proposed = logits[:, t - 1 :].argmax(-1)  # [batch, block]
    if greedy is None:
        greedy = greedy_tokens(model, windows, block_size)
    same = proposed == greedy[:, :block_size]  # [batch, block]
    prefix = same.int().cumprod(dim=1).sum(dim=1).float()  # [batch]
    return {"rate": same.float().mean(0).tolist(), "prefix": prefix.mean().item()}


@torch.no_grad()
def greedy_tokens(model, windows: torch.Tensor, num: int) -> torch.Tensor:
    """# [batch, num]: `num` greedy AR steps after each window # [batch, seq] (full re-reads, no
    cache: the diagnostics' reference, independent of the decoders under test)."""
    seq = windows
    for _ in range(num):
        nxt = model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)  # [batch, 1]
        seq = torch.cat([seq, nxt], dim=1)
    return seq[:, windows.shape[1]:]


def block_match_rate(model, windows: torch.Tensor, block_size: int, mask_token_id: int) -> list[float]:
    """Per-position share of the proposed block equal to the model's own greedy continuation."""
    return block_match(model, windows, block_size, mask_token_id)["rate"]


@torch.no_grad()
def drafter_match(target, drafter, windows: torch.Tensor, gamma: int, steps: int, mask_token_id: int) -> dict:
    """How far a diffusion draft after each window agrees with the target's greedy continuation:
    the mean prefix strict SDD accepts per round (`accepted`) and the per-position rate."""
    from vllm_prove.reference.drafter import DiffusionDrafter

    bsz = windows.shape[0]
    spec = getattr(drafter.config, "diffusion_drafter", None) or {}
    dd = DiffusionDrafter(drafter, mask_token_id=mask_token_id, gamma=gamma, steps=steps, batch_size=bsz, pad_id=0,
                          kind=spec.get("kind", "block"), logits_shift=bool(spec.get("logits_shift", False)))
    for r in range(bsz):
        dd.admit(r, windows[r].tolist())
    draft = dd.draft([True] * bsz).draft_token_ids  # [batch, gamma]
    same = draft == greedy_tokens(target, windows, gamma)  # [batch, gamma]
    return {"rate": same.float().mean(0).tolist(), "accepted": same.int().cumprod(dim=1).sum(dim=1).float().mean().item()}


@torch.no_grad()
def teacher_forced_agreement(reference, model, windows: torch.Tensor) -> float:
    """Share of positions of `windows` # [batch, seq] where `model`'s next-token argmax equals
    `reference`'s (both read the same real text)."""
    same = reference(input_ids=windows).logits.argmax(-1) == model(input_ids=windows).logits.argmax(-1)
    return same.float().mean().item()


def proposer_report(base, proposer, heldout_ds, mask_token_id: int, windows: torch.Tensor,
                    block_sizes: tuple[int, ...] = (4, 8, 16)) -> dict:
    """A trained proposer beside the model it started from, on held-out text: the AR-matching
    prefix per block size (the base reads the same, fresh, mask row), teacher-forced next-token
    agreement with the base, and both perplexities (`heldout_ds`: a `StreamDataset`)."""
    import math

    from vllm_prove.train.trainer import heldout_loss

    report = {"windows": list(windows.shape), "block_sizes": list(block_sizes)}
    for name, model in (("base", base), ("proposer", proposer)):
        greedy = model.generate(input_ids=windows, attention_mask=torch.ones_like(windows), do_sample=False,
                                max_new_tokens=max(block_sizes), min_new_tokens=max(block_sizes),
                                pad_token_id=0)[:, windows.shape[1]:]  # [batch, max B], KV-cached
        report[name] = {"matching_prefix": {str(b): round(block_match(model, windows, b, mask_token_id, greedy)["prefix"], 3)
                                            for b in block_sizes},
                        "perplexity": round(math.exp(heldout_loss(model, heldout_ds)), 3)}
    texts = heldout_ds.sample(16, torch.Generator().manual_seed(7)).input_ids  # [16, seq]
    report["teacher_forced_agreement"] = round(sum(teacher_forced_agreement(base, proposer, texts[i:i + 4])
                                                   for i in range(0, 16, 4)) / 4, 4)
    report["perplexity_ratio"] = round(report["proposer"]["perplexity"] / report["base"]["perplexity"], 4)
    return report
