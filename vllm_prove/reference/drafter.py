"""The diffusion drafter adapter: a masked diffusion LM loaded through transformers drafts a
block of `gamma` tokens in `T` denoising passes (docs/METHODS.md §7; the schedule and the
features are engine-free, in `vllm_prove.core.diffusion`).

Two kinds, chosen by config:

    block (ours):  [ committed prefix: causal, KV-cached | draft block: bidirectional ]
                   pass 0 reads the new committed tokens + gamma masks; later passes read only
                   the gamma block tokens over the cache: a pass costs gamma tokens, not the context
    full (Dream, DiffuCoder, MDLM checkpoints): every pass reads context + block, all
                   bidirectional, no cache

and two logit conventions (`logits_shift`): MDLM / BERT style, the output at a position
predicts that position; Dream / DiffuCoder style, the output at `p - 1` predicts `p` (the block's
first token is then predicted by the last committed token). With the shift and the block kind,
the last committed token never sees the block, so its prediction is the one from pass 0.

The mask id is never drafted (its logit is removed): Dream's mask id is a real id of Qwen's
vocabulary, and a drafted mask would be committed as that token.
"""

from __future__ import annotations

import enum

import torch

from vllm_prove.core.diffusion import DraftBlock, denoise, reveal_counts
from vllm_prove.errors import ProveError
from vllm_prove.reference.kv import BatchedKV, pad_rows


class DrafterKind(str, enum.Enum):
    BLOCK = "block"  # causal prefix (KV-cached) + bidirectional draft block
    FULL = "full"  # context + block, all bidirectional, recomputed every pass


class DiffusionDrafter:
    """Per-row drafting state over one masked diffusion LM (any batch size)."""

    def __init__(self, model, *, mask_token_id: int, gamma: int, steps: int, batch_size: int, pad_id: int,
                 kind: DrafterKind | str = DrafterKind.BLOCK, logits_shift: bool = False, use_cache: bool = True,
                 vocab_limit: int | None = None, features: bool = False, max_new_tokens: int = 64,
                 dataset: str = "code"):
        self.kind = DrafterKind(kind)
        self.counts = reveal_counts(gamma, steps)
        self.mask_id, self.gamma, self.steps, self.pad_id = mask_token_id, gamma, steps, pad_id
        self.shift, self.features = logits_shift, features
        self.cached = use_cache and self.kind is DrafterKind.BLOCK  # a full-attention pass cannot reuse a cache
        self.vocab_limit, self.max_new_tokens, self.dataset = vocab_limit, max_new_tokens, dataset
        self.kv = BatchedKV(model, batch_size)
        self.context = [[] for _ in range(batch_size)]  # every token of the row (uncached passes read it)
        self.pending = [[] for _ in range(batch_size)]  # committed, not yet in the cache
        self.generated = torch.zeros(batch_size, dtype=torch.long)  # [batch] tokens generated so far
        self.passes = 0

    def admit(self, row: int, prompt_ids: list[int]) -> None:
        self.kv.reset_rows([row])
        self.context[row], self.pending[row] = list(prompt_ids), list(prompt_ids)
        self.generated[row] = 0

    def advance(self, committed: list[list[int]]) -> None:
        """The tokens each row committed this round (the drafter reads them at its next pass)."""
        for r, toks in enumerate(committed):
            self.context[r] += toks
            self.pending[r] += toks
            self.generated[r] += len(toks)

    @torch.no_grad()
    def draft(self, active: list[bool]) -> DraftBlock:
        """Denoise `gamma` masks in `steps` passes (`core.diffusion.denoise`)."""
        block = denoise(lambda tokens, s: self._pass(tokens, active, s), torch.tensor(active), self.gamma,
                        self.steps, self.mask_id, features=self.features, generated=self.generated,
                        max_new_tokens=self.max_new_tokens, dataset=self.dataset)
        if self.cached:
            for r, a in enumerate(active):
                if a:
                    self.pending[r] = []
        return block

    def _pass(self, tokens: torch.Tensor, active: list[bool], step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One denoising pass; logits and LM-head inputs aligned so index j predicts block token j."""
        gamma = self.gamma
        if self.cached and step > 0:  # the prefix is in the cache: read the block alone
            prefix = [[] for _ in active]
        else:
            prefix = [(self.pending[r] if self.cached else self.context[r]) if a else [] for r, a in enumerate(active)]
            if not self.cached:
                self.kv.reset()
        rows = [p + tokens[r].tolist() if active[r] else [] for r, p in enumerate(prefix)]
        ids, lengths = pad_rows(rows, self.pad_id)
        start = torch.tensor([len(p) for p in prefix])  # [batch] first block column
        bidir = start if self.kind is DrafterKind.BLOCK else torch.zeros_like(start)
        logits, h = self.kv.extend(ids, lengths, bidirectional_from=bidir, output_hidden=True)
        self.passes += 1
        cols = start[:, None] + torch.arange(gamma)[None, :] - int(self.shift)  # [batch, gamma]
        idx = cols.clamp(min=0, max=ids.shape[1] - 1)  # -1 only for a cached shifted pass > 0: replaced below
        logits = logits.gather(1, idx[..., None].expand(-1, -1, logits.shape[-1]))  # [batch, gamma, vocab]
        h = h.gather(1, idx[..., None].expand(-1, -1, h.shape[-1]))  # [batch, gamma, hidden]
        if self.shift and self.cached:  # block token 0 is predicted by the last prefix token, read in pass 0
            if step == 0:
                self._first = (logits[:, 0].clone(), h[:, 0].clone())
            else:
                logits[:, 0], h[:, 0] = self._first
        if self.cached:
            if step == 0:
                self.kv.commit(torch.tensor([len(p) for p in prefix]))  # the prefix stays, the block goes
            else:
                self.kv.discard()
        logits[..., self.mask_id] = -torch.inf  # never draft the mask
        if self.vocab_limit is not None and self.vocab_limit < logits.shape[-1]:
            logits[..., self.vocab_limit:] = -torch.inf  # ids the target cannot read
        return logits, h


def check_drafter_tokenizer(drafter_tok, target_tok, mask_token_id: int, drafter_config=None) -> None:
    """Start-up checks: one vocabulary for drafter and target (the drafter's mask token aside),
    and one mask id (the given one, the drafter config's, the drafter tokenizer's)."""
    claims = {"given": mask_token_id,
              "drafter config mask_token_id": getattr(drafter_config, "mask_token_id", None),
              "drafter tokenizer mask_token_id": getattr(drafter_tok, "mask_token_id", None)}
    named = {k: v for k, v in claims.items() if v is not None}
    if len(set(named.values())) > 1:
        raise ProveError("diffusion drafter: mask token ids disagree: "
                         + ", ".join(f"{k} = {v}" for k, v in named.items()))
    d_vocab, t_vocab = drafter_tok.get_vocab(), target_tok.get_vocab()
    mask_piece = drafter_tok.convert_ids_to_tokens(mask_token_id)
    for piece, i in t_vocab.items():
        if piece != mask_piece and d_vocab.get(piece) != i:
            raise ProveError(f"diffusion drafter: token {piece!r} is id {i} for the target but "
                             f"{d_vocab.get(piece)} for the drafter; drafter and target need one vocabulary")


def resolve_drafter(path: str, target_tok, mask_token_id: int | None = None) -> tuple[int, dict]:
    """The drafter's mask id and `diffusion_drafter` spec (kind, logits_shift) from its folder,
    checked against the target's tokenizer (`check_drafter_tokenizer`)."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    d_tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    mask_id = mask_token_id
    for source in (getattr(config, "mask_token_id", None), getattr(d_tok, "mask_token_id", None)):
        mask_id = source if mask_id is None else mask_id
    if mask_id is None:
        raise ProveError(f"mask_token_id: the drafter at {path} names no mask token (config.json or tokenizer); "
                         "give the mask token id")
    check_drafter_tokenizer(d_tok, target_tok, mask_id, config)
    return int(mask_id), dict(getattr(config, "diffusion_drafter", None) or {})
