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
from dataclasses import dataclass

import torch

from vllm_prove.core.contracts import PLACEHOLDER_TOKEN_ID
from vllm_prove.core.diffusion import distribution_stats, reveal_counts, scalar_features, select_reveals
from vllm_prove.errors import ProveError
from vllm_prove.reference.kv import BatchedKV, pad_rows


class DrafterKind(str, enum.Enum):
    BLOCK = "block"  # causal prefix (KV-cached) + bidirectional draft block
    FULL = "full"  # context + block, all bidirectional, recomputed every pass


@dataclass(frozen=True)
class DraftBlock:
    """One drafted block per row (rows not drafting hold PLACEHOLDER_TOKEN_ID, n = 0)."""

    draft_token_ids: torch.Tensor  # [batch, gamma] int64
    num_draft_tokens: torch.Tensor  # [batch] int64
    confidence: torch.Tensor  # [batch, gamma] float: probability of the token at its reveal pass
    reveal_step: torch.Tensor  # [batch, gamma] int64
    hidden: torch.Tensor | None = None  # [batch, gamma, hidden]: LM-head input at the reveal pass
    scalars: torch.Tensor | None = None  # [batch, gamma, NUM_SCALAR_FEATURES]


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
        """Denoise `gamma` masks in `steps` passes, revealing the most confident each pass."""
        batch, gamma = len(active), self.gamma
        act = torch.tensor(active)[:, None]  # [batch, 1]
        tokens = torch.full((batch, gamma), self.mask_id, dtype=torch.long)
        masked = act.expand(batch, gamma).clone()  # [batch, gamma]
        confidence = torch.zeros(batch, gamma)
        step_of = torch.zeros(batch, gamma, dtype=torch.long)
        rank = torch.zeros(batch, gamma, dtype=torch.long)
        hidden = stats_at = first = None
        for s, count in enumerate(self.counts):
            logits, h = self._pass(tokens, active, s)  # [batch, gamma, vocab], [batch, gamma, hidden]
            stats = distribution_stats(torch.softmax(logits, dim=-1))  # each [batch, gamma]
            if s == 0:
                first = stats
                stats_at = {k: v.clone() for k, v in stats.items()}
                hidden = torch.zeros(batch, gamma, h.shape[-1]) if self.features else None
            reveal = select_reveals(stats["top1_prob"], masked, count)  # [batch, gamma]
            tokens = torch.where(reveal, stats["token"], tokens)
            confidence = torch.where(reveal, stats["top1_prob"], confidence)
            step_of = torch.where(reveal, s, step_of)
            order = torch.cumsum(reveal.long(), 1) - 1 + (~masked & act).sum(1, keepdim=True)  # rank within reveals
            rank = torch.where(reveal, order, rank)
            for k in stats_at:
                stats_at[k] = torch.where(reveal, stats[k], stats_at[k])
            if hidden is not None:
                hidden = torch.where(reveal[..., None], h, hidden)
            masked &= ~reveal
        if self.cached:
            for r, a in enumerate(active):
                if a:
                    self.pending[r] = []
        n = torch.where(act[:, 0], gamma, 0)
        tokens = torch.where(act, tokens, PLACEHOLDER_TOKEN_ID)
        scalars = None
        if self.features:
            scalars = scalar_features(stats_at, first, step_of, rank, self.generated, self.max_new_tokens,
                                      self.steps, self.dataset)
        return DraftBlock(tokens, n, confidence, step_of, hidden, scalars)

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
