"""Reference decoders (docs/METHODS.md §3-5): AR, SD, MARS, ProVe, ProVe-lossless.

Plain PyTorch + transformers with KV caches (`BatchedKV`), any batch size. Each decoder keeps,
per row, the tokens it has committed but not yet written into a model's cache (`pending`):
the next pass reads them first, so nothing is recomputed from scratch. Each `cycle()` returns,
per row, the committed tokens and a `CycleRecord`, and reads like the paper's algorithm box.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_prove.config import DecodeConfig, Method
from vllm_prove.core.contracts import BlockProposal
from vllm_prove.core.fused import token_prob, top1_confidence
from vllm_prove.core.rules import apply_gate, lossless_greedy, proposer_only_gate
from vllm_prove.reference.kv import BatchedKV, pad_rows


@dataclass
class CycleRecord:
    """What one cycle did for one request (written once, then read by metrics)."""

    committed: int
    proposed: list[int] = field(default_factory=list)
    proposer_probs: list[float] = field(default_factory=list)
    verifier_probs: list[float] = field(default_factory=list)
    ar_match: int | None = None  # AR-matching prefix of the proposed block (if tracked)


def row_lengths(rows: list[list[int]], active: list[bool]) -> torch.Tensor:
    """# [batch] int64: len(rows[r]) for active rows, 0 for free ones."""
    return torch.tensor([len(row) if a else 0 for row, a in zip(rows, active)], dtype=torch.long)


def _window(logits: torch.Tensor, start: torch.Tensor, num: int) -> torch.Tensor:
    """logits # [batch, n, vocab] -> # [batch, num, vocab], columns start[r] .. start[r] + num - 1."""
    idx = (start.clamp(min=0)[:, None] + torch.arange(num)[None, :]).clamp(max=logits.shape[1] - 1)
    return logits.gather(1, idx[..., None].expand(-1, -1, logits.shape[-1]))


def _last_argmax(logits: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Greedy token after each row's last real column: # [batch] int64."""
    return _window(logits, lengths - 1, 1)[:, 0].argmax(-1)


class Decoder:
    """Per-row state shared by every method; subclasses implement `cycle()`."""

    method: Method

    def __init__(self, cfg: DecodeConfig, proposer, verifier=None, *, mask_token_id: int, pad_id: int,
                 track_ar_match: bool = False):
        self.cfg, self.B, self.mask_id, self.pad_id = cfg, cfg.block_size, mask_token_id, pad_id
        self.track_ar_match = track_ar_match
        self.kv_p = BatchedKV(proposer, cfg.batch_size)
        self.kv_v = BatchedKV(verifier, cfg.batch_size) if verifier is not None else None
        self.pending = [[] for _ in range(cfg.batch_size)]  # committed, not yet in the proposer cache
        self.v_pending = [[] for _ in range(cfg.batch_size)]  # same for the verifier / drafter

    def admit(self, row: int, prompt_ids: list[int]) -> None:
        """A new request takes `row`: its prompt is read by the row's next pass (no prefill step)."""
        for kv in (self.kv_p, self.kv_v):
            if kv is not None:
                kv.reset_rows([row])
        self.pending[row] = list(prompt_ids)
        self.v_pending[row] = list(prompt_ids)

    def models(self) -> dict[str, BatchedKV]:
        return {"proposer": self.kv_p} | ({"verifier": self.kv_v} if self.kv_v is not None else {})

    # -- passes shared by the block methods ------------------------------------------------
    def _propose(self, active: list[bool]) -> BlockProposal:
        """One proposer pass over `pending + (B-1) masks` (docs/METHODS.md §1)."""
        rows = [self.pending[r] + [self.mask_id] * (self.B - 1) if active[r] else [] for r in range(len(active))]
        ids, lengths = pad_rows(rows, self.pad_id)
        logits = self.kv_p.extend(ids, lengths)  # [batch, n, vocab]
        block_logits = _window(logits, row_lengths(self.pending, active) - 1, self.B)  # [batch, block, vocab]
        y, p_tilde = top1_confidence(block_logits.flatten(0, 1))  # [batch * block] each
        shape = block_logits.shape[:2]
        return BlockProposal(y.view(shape), p_tilde.view(shape), torch.full((len(active),), self.B, dtype=torch.long))

    def _teacher_force(self, kv: BatchedKV, prefix: list[list[int]], block: torch.Tensor, num_out: int,
                       active: list[bool]) -> torch.Tensor:
        """Read `prefix[r] + block[r]` # block: [batch, n]; return logits # [batch, num_out, vocab]
        from the last prefix token on (from block[:, 0] when the prefix is empty)."""
        rows = [prefix[r] + block[r].tolist() if active[r] else [] for r in range(len(active))]
        ids, lengths = pad_rows(rows, self.pad_id)
        logits = kv.extend(ids, lengths)  # [batch, n, vocab]
        return _window(logits, row_lengths(prefix, active) - 1, num_out)

    def _ar_match(self, proposal: BlockProposal, active: list[bool]) -> torch.Tensor:
        """Diagnostic, # [batch, block] bool: y_i == g_i, the proposer's greedy AR prediction
        given context + y_<i, from a teacher-forced proposer pass that is then discarded.
        Call after the propose pass's commit (the masks must be gone)."""
        y = proposal.draft_token_ids  # [batch, block]
        empty = [[] for _ in active]
        g = self._teacher_force(self.kv_p, empty, y[:, :-1], self.B - 1, active).argmax(-1)  # g_2..g_B
        self.kv_p.discard()
        matches = torch.ones_like(y, dtype=torch.bool)
        matches[:, 1:] = y[:, 1:] == g  # y_1 is the AR token by construction (docs/METHODS.md §1)
        return matches

    def _records(self, proposal, committed, q=None, matches=None) -> list[CycleRecord]:
        recs = []
        for r in range(proposal.batch_size):
            ar = None if matches is None else int(torch.cumprod(matches[r].long(), 0).sum())
            recs.append(CycleRecord(
                committed=len(committed[r]), proposed=proposal.draft_token_ids[r].tolist(),
                proposer_probs=proposal.proposer_probs[r].tolist(),
                verifier_probs=[] if q is None else q[r].tolist(), ar_match=ar))
        return recs

    def cycle(self, active: list[bool]) -> tuple[list[list[int]], list[CycleRecord]]:
        raise NotImplementedError


class ARDecoder(Decoder):
    """Greedy AR: one proposer pass, one token."""

    method = Method.AR

    def cycle(self, active):
        ids, lengths = pad_rows([p if a else [] for p, a in zip(self.pending, active)], self.pad_id)
        logits = self.kv_p.extend(ids, lengths)  # [batch, n, vocab]
        nxt = _last_argmax(logits, lengths)  # [batch]
        self.kv_p.commit(lengths)
        committed = [[int(nxt[r])] if active[r] else [] for r in range(len(active))]
        self.pending = [c or p for c, p in zip(committed, self.pending)]
        return committed, [CycleRecord(committed=len(c)) for c in committed]


class MarsDecoder(Decoder):
    """MARS confidence rule (docs/METHODS.md §5): propose, commit y_1 and then while p~_i >= tau."""

    method = Method.MARS

    def cycle(self, active):
        proposal = self._propose(active)  # pass 1: pending + B-1 masks
        self.kv_p.commit(row_lengths(self.pending, active))
        matches = self._ar_match(proposal, active) if self.track_ar_match else None
        verdict = proposer_only_gate(proposal, self.cfg.tau)
        committed = [row if a else [] for row, a in zip(verdict.to_lists(), active)]
        self.pending = [c or p for c, p in zip(committed, self.pending)]  # the next window
        return committed, self._records(proposal, committed, matches=matches)


class ProveDecoder(Decoder):
    """ProVe (docs/METHODS.md §3): the proposer proposes, a small verifier scores, the gate commits."""

    method = Method.PROVE

    def cycle(self, active):
        proposal = self._propose(active)  # pass 1: pending + B-1 masks
        self.kv_p.commit(row_lengths(self.pending, active))
        matches = self._ar_match(proposal, active) if self.track_ar_match else None
        y = proposal.draft_token_ids  # [batch, block]
        logits = self._teacher_force(self.kv_v, self.v_pending, y[:, :-1], self.B, active)  # pass 2
        q = token_prob(logits.flatten(0, 1), y.flatten()).view_as(proposal.proposer_probs)  # [batch, block]
        verdict = apply_gate(self.cfg.gate, proposal, q, self.cfg.theta if self.cfg.gate.needs_verifier
                             else self.cfg.tau)
        a = verdict.num_accepted  # [batch]
        # the verifier keeps v_pending + y_1..y_{a-1}; y_a is read first next cycle (it scores q_1)
        self.kv_v.commit(torch.where(torch.tensor(active), row_lengths(self.v_pending, active) + a - 1, 0))
        committed = [row if x else [] for row, x in zip(verdict.to_lists(), active)]
        self.pending = [c or p for c, p in zip(committed, self.pending)]
        self.v_pending = [c[-1:] or v for c, v in zip(committed, self.v_pending)]
        return committed, self._records(proposal, committed, q=q, matches=matches)


class LosslessDecoder(Decoder):
    """ProVe-lossless (docs/METHODS.md §4): the proposer verifies its own block; greedy AR exactly."""

    method = Method.PROVE_LOSSLESS

    def cycle(self, active):
        proposal = self._propose(active)  # pass 1: pending + B-1 masks
        self.kv_p.commit(row_lengths(self.pending, active))
        y = proposal.draft_token_ids  # [batch, block]
        empty = [[] for _ in active]
        g_next = self._teacher_force(self.kv_p, empty, y, self.B, active).argmax(-1)  # pass 2: g_2..g_{B+1}
        target = torch.cat([y[:, :1], g_next], dim=1)  # g_1 = y_1: the AR head on the real context
        verdict = lossless_greedy(y, proposal.num_draft_tokens, target)
        self.kv_p.commit(torch.where(torch.tensor(active), verdict.num_accepted, 0))  # accepted stay real
        committed = [row if x else [] for row, x in zip(verdict.to_lists(), active)]
        self.pending = [c[-1:] or p for c, p in zip(committed, self.pending)]  # the recovered / bonus token
        matches = (y == target[:, :-1]) if self.track_ar_match else None
        return committed, self._records(proposal, committed, matches=matches)


class SDDecoder(Decoder):
    """Speculative decoding (docs/METHODS.md §5): the small model drafts k tokens serially, the
    proposer (as target) verifies greedily. `kv_v` holds the drafter."""

    method = Method.SD

    def cycle(self, active):
        k, n = self.cfg.k, len(active)
        feed, drafts = [v if a else [] for v, a in zip(self.v_pending, active)], []
        for _ in range(k):  # k serial drafter passes
            ids, lengths = pad_rows(feed, self.pad_id)
            logits = self.kv_v.extend(ids, lengths)
            d = _last_argmax(logits, lengths)  # [batch]
            drafts.append(d)
            feed = [[int(d[r])] if active[r] else [] for r in range(n)]
        d = torch.stack(drafts, dim=1)  # [batch, k]
        logits = self._teacher_force(self.kv_p, self.pending, d, k + 1, active)  # target pass
        verdict = lossless_greedy(d, torch.full((n,), k, dtype=torch.long), logits.argmax(-1))
        a = torch.where(torch.tensor(active), verdict.num_accepted, 0)  # [batch]
        self.kv_p.commit(row_lengths(self.pending, active) + a)
        self.kv_v.commit(row_lengths(self.v_pending, active) + a.clamp(max=k - 1))  # d_k was never fed to the drafter
        committed = [row if x else [] for row, x in zip(verdict.to_lists(), active)]
        self.pending = [c[-1:] or p for c, p in zip(committed, self.pending)]
        self.v_pending = [c[min(int(a[r]), k - 1):] or self.v_pending[r] for r, c in enumerate(committed)]
        recs = [CycleRecord(committed=len(c), proposed=d[r].tolist()) for r, c in enumerate(committed)]
        return committed, recs


DECODERS: dict[Method, type[Decoder]] = {
    cls.method: cls for cls in (ARDecoder, SDDecoder, MarsDecoder, ProveDecoder, LosslessDecoder)
}
