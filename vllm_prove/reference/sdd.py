"""Speculative diffusion decoding (docs/METHODS.md §7): strict, lenience, top-k, verifier skipping.

A diffusion drafter drafts `gamma` tokens in `T` passes; the AR target (the zoo's proposer, or
any HF causal LM) verifies them in one pass. Per row, a round is either

    verified:  draft -> target pass over pending + x_1..x_gamma -> rule -> commit accepted + 1
    skipped:   draft -> policy commits x_1..x_K^ with no target pass; the target reads them
               (computes their KV) at the row's next verification, as vLLM's scheduler would

`D` (unverified tokens since the row's last verification) is the policy's only state. A shadow
target pass audits skipped rounds (what strict SDD would have accepted, `L`) and is excluded
from the pass counts and the timing: it changes nothing the decoder does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_prove.config import DecodeConfig, Method, SkipSignal
from vllm_prove.core.diffusion import DraftBlock
from vllm_prove.core.rules import lenient_accept, strict_greedy, topk_accept
from vllm_prove.core.skip_policy import PrefixGate, SkipPolicy, guard_flags
from vllm_prove.errors import ProveError
from vllm_prove.reference.decoders import CycleRecord, Decoder, row_lengths
from vllm_prove.reference.drafter import DiffusionDrafter

SIGNAL_GATES = {SkipSignal.RAW: PrefixGate.GEOMETRIC_MEAN, SkipSignal.MARGINAL: PrefixGate.MIN,
                SkipSignal.CONDITIONAL: PrefixGate.PRODUCT}
NOT_AUDITED = -1  # L of a skipped round when the shadow verifier is off


@dataclass
class RoundRecord(CycleRecord):
    """One SDD round of one request (CycleRecord's fields + the round's verdict)."""

    verified: bool = True  # the target ran for this row
    drafted: bool = True  # False for a request's first round: the prompt's pass yields its first token
    K_hat: int = 0  # feasible prefix (sdd-skip)
    relaxed: int = 0  # K_b: draft tokens committed by a relaxed rule (skip, lenience, top-k); 0 if strict
    strict: int = NOT_AUDITED  # L_b: draft tokens strict verification accepts
    forced: bool = False  # a strict round forced by S_max
    reveal_steps: list[int] | None = None
    features: tuple[torch.Tensor, torch.Tensor] | None = None  # ([gamma, hidden], [gamma, 19]) for survival training


class SDDDecoder(Decoder):
    """Strict SDD: the target's argmax decides; greedy AR of the target token for token."""

    method = Method.SDD
    relaxed_verify = False  # the rule accepts tokens strict SDD would not (lenience, top-k)

    def __init__(self, cfg: DecodeConfig, target, drafter: DiffusionDrafter, *, pad_id: int,
                 special_token_ids: list[int], scorer=None, track_ar_match: bool = False):
        super().__init__(cfg, target, None, mask_token_id=drafter.mask_id, pad_id=pad_id)
        self.drafter, self.special, self.scorer = drafter, special_token_ids, scorer
        self.unverified = torch.zeros(cfg.batch_size, dtype=torch.long)  # [batch] D
        self.policy = SkipPolicy(K_min=cfg.k_min, S_max=cfg.s_max, eta_b=cfg.eta_b, eta_c=cfg.eta_c,
                                 gate=SIGNAL_GATES[cfg.signal])
        self.untimed_seconds = 0.0  # shadow passes: excluded from throughput

    def admit(self, row, prompt_ids):
        super().admit(row, prompt_ids)
        self.drafter.admit(row, prompt_ids)
        self.unverified[row] = 0

    def verify(self, x, n, logits):  # [batch, gamma], [batch], [batch, gamma + 1, vocab] -> Verdict
        return strict_greedy(x, n, logits)

    def skip(self, draft: DraftBlock, active: list[bool]):  # -> (skip [batch] bool, K^ [batch], forced)
        never = torch.zeros(len(active), dtype=torch.bool)
        return never, torch.zeros(len(active), dtype=torch.long), never

    def cycle(self, active):
        # A request's first round reads its prompt and commits the target's first token, as a
        # serving engine's prefill step does; the drafter drafts from the round after.
        drafting = [a and int(self.drafter.generated[r]) > 0 for r, a in enumerate(active)]
        draft = self.drafter.draft(drafting)  # T denoising passes
        x, n = draft.draft_token_ids, draft.num_draft_tokens  # [batch, gamma], [batch]: n = 0 if not drafting
        skip, K_hat, forced = self.skip(draft, drafting)  # [batch] each
        verify = [a and not bool(s) for a, s in zip(active, skip)]
        accepted = strict_l = torch.zeros(len(active), dtype=torch.long)  # [batch]
        committed = [[] for _ in active]
        if any(verify):  # one target pass over the verifying rows
            logits = self._teacher_force(self.kv_p, self.pending, x.clamp(min=0), self.drafter.gamma + 1, verify)
            strict = strict_greedy(x, n, logits)  # L_b: the same pass, strict rule
            verdict = self.verify(x, n, logits) if self.relaxed_verify else strict
            accepted = torch.where(torch.tensor(verify), verdict.num_accepted, 0)
            self.kv_p.commit(row_lengths(self.pending, verify) + accepted)
            strict_l = strict.num_accepted
            committed = [row if v else [] for row, v in zip(verdict.to_lists(), verify)]
        audit = self._shadow(x, n, skip) if bool(skip.any()) and self.cfg.shadow else None
        for r in range(len(active)):
            if skip[r]:
                committed[r] = x[r, : int(K_hat[r])].tolist()
                self.pending[r] = self.pending[r] + committed[r]  # the target reads them at its next pass
            elif verify[r]:
                self.pending[r] = committed[r][-1:]
        self.unverified = torch.where(skip, self.unverified + K_hat, torch.where(torch.tensor(active), 0,
                                                                                 self.unverified))
        self.drafter.advance(committed)
        recs = []
        for r in range(len(active)):
            strict = int(strict_l[r]) if verify[r] else (int(audit[r]) if audit is not None else NOT_AUDITED)
            relaxed = int(K_hat[r]) if skip[r] else (int(accepted[r]) if self.relaxed_verify and verify[r] else 0)
            feats = None
            if draft.hidden is not None and drafting[r]:
                feats = (draft.hidden[r].clone(), draft.scalars[r].clone())
            recs.append(RoundRecord(committed=len(committed[r]), proposed=x[r].tolist() if drafting[r] else [],
                                    proposer_probs=draft.confidence[r].tolist() if drafting[r] else [],
                                    verified=verify[r], drafted=drafting[r],
                                    K_hat=int(K_hat[r]), relaxed=relaxed, strict=strict, forced=bool(forced[r]),
                                    reveal_steps=draft.reveal_step[r].tolist(), features=feats))
        return committed, recs

    def _shadow(self, x, n, skip) -> torch.Tensor:
        """L for skipped rows from a target pass that leaves no trace (cache, counts, time)."""
        t0, passes, rows = time.perf_counter(), self.kv_p.passes, self.kv_p.rows
        rows_on = [bool(s) for s in skip]
        logits = self._teacher_force(self.kv_p, self.pending, x.clamp(min=0), self.drafter.gamma + 1, rows_on)
        self.kv_p.discard()
        self.kv_p.passes, self.kv_p.rows = passes, rows
        self.untimed_seconds += time.perf_counter() - t0
        return strict_greedy(x, n, logits).num_accepted


class LenienceDecoder(SDDDecoder):
    method = Method.SDD_LENIENCE
    relaxed_verify = True

    def verify(self, x, n, logits):
        return lenient_accept(x, n, logits, self.cfg.lenience)


class TopKDecoder(SDDDecoder):
    method = Method.SDD_TOPK
    relaxed_verify = True

    def verify(self, x, n, logits):
        return topk_accept(x, n, logits, self.cfg.top_k)


class SkipDecoder(SDDDecoder):
    """Strict SDD whose policy may commit a confident draft prefix without the target (§7)."""

    method = Method.SDD_SKIP

    def skip(self, draft, active):
        scores = draft.confidence if self.scorer is None else self.scorer(draft)  # [batch, gamma] q_j
        K_hat = self.policy.feasible_prefix(scores, draft.num_draft_tokens)  # [batch]
        left = self.cfg.max_tokens - self.drafter.generated  # [batch]
        guards = guard_flags(draft.draft_token_ids.clamp(min=0), scores, K_hat, self.special, left,
                             num_draft_tokens=draft.num_draft_tokens)
        decision = self.policy.decide(K_hat, self.unverified, guards)
        act = torch.tensor(active)
        return decision.skip & act, K_hat, decision.forced_strict & act


SDD_DECODERS: dict[Method, type[SDDDecoder]] = {
    cls.method: cls for cls in (SDDDecoder, LenienceDecoder, TopKDecoder, SkipDecoder)
}


def load_survival_predictor(folder: str | Path, signal: SkipSignal):
    """`folder/{signal}.pt` written by `vllm-prove train survival`, or a clear error."""
    from vllm_prove.train.survival import load_predictor

    path = Path(folder) / f"{signal.value}.pt"
    if not path.exists():
        raise ProveError(f"survival: {path} does not exist; train it with `vllm-prove train survival "
                         f"--signal {signal.value} --out {folder}`")
    return load_predictor(path)


def guarded_token_ids(tokenizer, mask_token_id: int) -> list[int]:
    """The ids a skip must never commit: the tokenizer's special tokens, EOS and the drafter's
    mask (one list for the reference decoder and the vLLM drafter, so both skip alike)."""
    return sorted((set(tokenizer.all_special_ids) | {tokenizer.eos_token_id, mask_token_id}) - {None})


def build_sdd_decoder(cfg: DecodeConfig, models, *, features: bool = False) -> SDDDecoder:
    """The SDD decoder of `cfg.method` over `models` (runner.Models with a drafter)."""
    tok, spec = models.tokenizer, models.drafter_spec
    drafter = DiffusionDrafter(models.drafter, mask_token_id=models.drafter_mask_id, gamma=cfg.gamma, steps=cfg.steps,
                               batch_size=cfg.batch_size, pad_id=tok.eos_token_id, kind=spec.get("kind", "block"),
                               logits_shift=bool(spec.get("logits_shift", False)),
                               vocab_limit=models.proposer.config.vocab_size, features=features,
                               max_new_tokens=cfg.max_tokens)
    scorer = None
    if cfg.method is Method.SDD_SKIP and cfg.signal is not SkipSignal.RAW:
        from vllm_prove.train.survival import block_scores

        predictor = load_survival_predictor(cfg.survival, cfg.signal)
        scorer = lambda d: block_scores(predictor, d.hidden, d.scalars)  # noqa: E731
        drafter.features = True
    special = guarded_token_ids(tok, models.drafter_mask_id)
    return SDD_DECODERS[cfg.method](cfg, models.proposer, drafter, pad_id=tok.eos_token_id,
                                    special_token_ids=special, scorer=scorer)


def sdd_summary(records: list[RoundRecord], num_tokens: int) -> dict:
    """Verifier calls and draft blocks per generated token, skipped rounds, StrictToken and
    FullPrefix over the rounds that committed a relaxed prefix (docs/METHODS.md §7)."""
    from vllm_prove.core.metrics import full_prefix_acceptance, strict_token_agreement

    calls, blocks = sum(r.verified for r in records), sum(r.drafted for r in records)
    out = {"verifier_calls": calls, "draft_blocks": blocks,
           "verifier_calls_per_token": round(calls / max(1, num_tokens), 4),
           "draft_blocks_per_token": round(blocks / max(1, num_tokens), 4),
           "skipped_rounds": sum(not r.verified for r in records),
           "skipped_tokens": sum(r.committed for r in records if not r.verified),
           "forced_strict_rounds": sum(r.forced for r in records),
           "strict_accepted_per_round": round(sum(max(0, r.strict) for r in records if r.verified and r.drafted)
                                              / max(1, sum(r.verified and r.drafted for r in records)), 4)}
    audited = [r for r in records if r.relaxed > 0 and r.strict != NOT_AUDITED]
    if audited:
        K, L = [r.relaxed for r in audited], [r.strict for r in audited]
        out |= {"strict_token": round(strict_token_agreement(K, L), 4),
                "full_prefix": round(full_prefix_acceptance(K, L), 4)}
    return out


def write_traces(results, path, features_path=None) -> None:
    """Per-round traces as JSONL (one line per request and round); with `features_path`, the
    survival predictors' training data (`vllm-prove train survival` reads it)."""
    import json

    lines, hidden, scalars, accepted, n, prompt_id, conf = [], [], [], [], [], [], []
    for res in results:
        for i, rec in enumerate(res.records):
            if not rec.drafted:
                continue
            lines.append(json.dumps({"prompt": res.index, "round": i, "verified": rec.verified,
                                     "committed": rec.committed, "K_hat": rec.K_hat, "relaxed": rec.relaxed,
                                     "strict": rec.strict, "forced": rec.forced, "draft": rec.proposed,
                                     "confidence": [round(c, 5) for c in rec.proposer_probs],
                                     "reveal_steps": rec.reveal_steps}) + "\n")
            if rec.features is not None and rec.strict != NOT_AUDITED:
                hidden.append(rec.features[0])
                scalars.append(rec.features[1])
                accepted.append(rec.strict)
                n.append(len(rec.proposed))
                prompt_id.append(res.index)
                conf.append(torch.tensor(rec.proposer_probs))
    Path(path).write_text("".join(lines))
    if features_path is not None:
        from vllm_prove.core.diffusion import SCALAR_FEATURES

        if not hidden:
            raise ValueError("no audited round carries features: run with features on (strict SDD traces)")
        torch.save({"hidden": torch.stack(hidden), "scalars": torch.stack(scalars),
                    "accepted": torch.tensor(accepted), "num_draft_tokens": torch.tensor(n),
                    "prompt_id": torch.tensor(prompt_id), "confidence": torch.stack(conf),
                    "scalar_names": list(SCALAR_FEATURES)}, features_path)
