"""Speculative diffusion decoding inside vLLM (docs/METHODS.md §7): mode ``sdd``.

vLLM loads the diffusion drafter like any draft model (``speculative_config`` method
``draft_model``; its attention layers get their own KV in the target's block table) and verifies
its ``gamma`` drafts with its own rejection sampler, so strict SDD is greedy AR exactly and exact
speculative sampling at temperature > 0. Three pieces change:

``DiffusionProposer.propose`` drafts a block instead of ``gamma`` autoregressive tokens::

    KV positions:  ... | p-1  p   | p+1  p+2 ... p+gamma        (p: the token just sampled, s)
    prefix pass:       | ...  s   |                              causal: the step's committed tokens
    block pass t:      |          | x_1  x_2 ... x_gamma         bidirectional over the cache
                                                                 (masks at t = 0), T passes

With Dream-style shifted logits block token ``j`` is read at position ``p + j - 1`` (token 1 from
``s`` in the prefix pass). The block's KV slots lie in the look-ahead the scheduler reserves; the
next step's prefix pass rewrites the committed ones with real tokens before anything reads them.

Verifier skipping (``rule = "skip"``): after drafting, the core's ``SkipPolicy`` judges each greedy
request's block. A request that skips commits ``x_1..x_K^`` at once (appended to this step's
sampled tokens, ``SDDRunnerMixin``), and the drafter drafts again after them in the same step
(a causal pass over the K^ tokens, then the block passes), until the policy asks for the target
or ``S_max`` forces it. The target reads the skipped tokens at that request's next step, as a
chunk before the drafts (vLLM schedules every uncomputed token); ``SDDScheduler`` keeps
``num_computed_tokens`` and the spec-decode counters to what the target has read and verified.
Other requests in the batch are unaffected: skipping changes only that request's rows.

``lenience`` / ``topk``: the runner's ``_sample`` applies the core's relaxed rule to the window
logits of greedy requests (vLLM's sampler keeps every other request).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput, SamplerOutput
from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.spec_decode.utils import PADDING_SLOT_ID

from vllm_prove.config import ProveEngineConfig, SkipSignal
from vllm_prove.core.diffusion import DraftBlock, denoise
from vllm_prove.core.rules import lenient_accept, strict_greedy, topk_accept
from vllm_prove.core.skip_policy import SkipPolicy, guard_flags
from vllm_prove.engine import gate
from vllm_prove.engine.requests import request_gate_serves
from vllm_prove.engine.seeded import WholeSeededSteps
from vllm_prove.engine.settings import engine_settings

logger = init_logger(__name__)
SKIPPED_ATTR = "prove_skipped"  # ModelRunnerOutput attribute: {req_id: tokens committed by a skip}


@dataclass
class SDDCounters:
    """Worker-side counts of one engine (``collective_rpc("prove_sdd_counters")``)."""

    draft_blocks: int = 0  # blocks drafted for requests whose sample counts
    verified_blocks: int = 0  # target passes that gave a request tokens (verifier calls; prefills included)
    skipped_rounds: int = 0
    skipped_tokens: int = 0
    relaxed: list[int] = field(default_factory=list)  # lenience / topk: K_b per window that relaxed
    strict: list[int] = field(default_factory=list)  # L_b: what strict verification accepted there
    skips: list[tuple[str, int, int]] = field(default_factory=list)  # (request, output index, K) per skip

    def summary(self) -> dict:
        from vllm_prove.core.metrics import full_prefix_acceptance, strict_token_agreement

        out = {"draft_blocks": self.draft_blocks, "verifier_calls": self.verified_blocks,
               "skipped_rounds": self.skipped_rounds, "skipped_tokens": self.skipped_tokens,
               "skips": list(self.skips)}
        pairs = [(k, s) for k, s in zip(self.relaxed, self.strict) if k > 0]
        if pairs:
            K, L = zip(*pairs)
            out |= {"strict_token": round(strict_token_agreement(list(K), list(L)), 4),
                    "full_prefix": round(full_prefix_acceptance(list(K), list(L)), 4)}
        return out


class DiffusionProposer(DraftModelProposer):
    """vLLM's draft-model proposer whose model is a block-diffusion drafter (see the module)."""

    def __init__(self, vllm_config, device: torch.device, runner, settings: ProveEngineConfig):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        from transformers import AutoConfig

        spec = dict(getattr(AutoConfig.from_pretrained(settings.drafter, trust_remote_code=True),
                            "diffusion_drafter", None) or {})
        self.shift = bool(spec.get("logits_shift", False))
        self._runner = runner
        self.gamma, self.steps, self.mask_id = settings.block_size, settings.steps, settings.mask_token_id
        self.vocab_limit = vllm_config.model_config.get_vocab_size()
        self._offsets = torch.arange(self.gamma, device=device)  # [gamma]
        self.counters = SDDCounters()
        self.skipped: dict[int, list[list[int]]] = {}  # batch row -> tokens of each skipped round this step
        self.policy = self.scorer = None
        if settings.rule == "skip":
            from vllm_prove.reference.sdd import SIGNAL_GATES

            self.policy = SkipPolicy(K_min=settings.k_min, S_max=settings.s_max, eta_b=settings.eta_b,
                                     eta_c=settings.eta_c, gate=SIGNAL_GATES[settings.signal])
            if settings.signal is not SkipSignal.RAW:
                from vllm_prove.reference.sdd import load_survival_predictor
                from vllm_prove.train.survival import block_scores

                predictor = load_survival_predictor(settings.survival, settings.signal)
                self.scorer = lambda d: block_scores(predictor, d.hidden, d.scalars)  # noqa: E731
            self.special = self._special_token_ids(vllm_config.model_config, settings.mask_token_id)

    @staticmethod
    def _special_token_ids(model_config, mask_token_id: int) -> list[int]:
        from transformers import AutoTokenizer

        from vllm_prove.reference.sdd import guarded_token_ids

        tok = AutoTokenizer.from_pretrained(model_config.tokenizer, trust_remote_code=model_config.trust_remote_code)
        return guarded_token_ids(tok, mask_token_id)

    def prepare_next_token_ids_padded(self, sampled_token_ids, requests, input_batch, discard_request_mask):
        """vLLM's, keeping the number of tokens each request commits this step (skip guards)."""
        next_token_ids, valid_count = super().prepare_next_token_ids_padded(
            sampled_token_ids, requests, input_batch, discard_request_mask)
        self._valid_count = valid_count
        return next_token_ids, valid_count

    @torch.inference_mode()
    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None) -> torch.Tensor:
        """``[batch, num_speculative_tokens]`` drafts: the prefix pass, then ``T`` block passes."""
        self.num_speculative_tokens, self._last_draft_probs = num_speculative_tokens, None
        self.skipped = {}
        num_tokens, sample_index, cad = self.set_inputs_first_pass(
            target_token_ids=target_token_ids, next_token_ids=next_token_ids, target_positions=target_positions,
            target_hidden_states=target_hidden_states, token_indices_to_sample=token_indices_to_sample,
            cad=common_attn_metadata, num_rejected_tokens_gpu=num_rejected_tokens_gpu)
        hidden = self._forward(self.input_ids[:num_tokens], self.positions[:num_tokens], cad)  # [num_tokens, H]
        last = hidden[sample_index]  # [batch, H]: at s, the token just sampled
        start = self.positions[sample_index].to(torch.int64) + 1  # [batch] position of block token 1
        table = cad.block_table_tensor[: cad.batch_size()]  # [batch, max_blocks]
        counted = self._counted_rows(cad.batch_size())  # [batch] bool: rows whose sample counts
        lengths = (self._generated(counted), self._max_tokens(cad.batch_size())) if self.scorer is not None else None
        block = self._draft(last, start, table, lengths)
        if self.policy is not None:
            block = self._skip_rounds(block, start, table, counted)
        self.counters.draft_blocks += int(counted.sum())
        return block.draft_token_ids[:, :num_speculative_tokens]

    # -- drafting ------------------------------------------------------------------------------

    def _draft(self, last: torch.Tensor, start: torch.Tensor, table: torch.Tensor,
               lengths: tuple[torch.Tensor, torch.Tensor] | None) -> DraftBlock:
        """One block per row after the committed prefix ending at ``start - 1`` (``last``: the
        drafter's hidden state there); ``T`` bidirectional passes over the block's slots. With
        ``lengths`` (per row: tokens generated so far, max_tokens) the block carries the survival
        predictors' features."""
        rows, gamma = start.shape[0], self.gamma
        first = (self.model.compute_logits(last), last)  # block token 1 under shifted logits
        positions = (start[:, None] + self._offsets[None, :]).reshape(-1)  # [rows * gamma]
        query_lens = torch.full((rows,), gamma, dtype=torch.int64, device=self.device)
        block_cad = self._attn_metadata(positions, query_lens, start + gamma, table, causal=False)

        def one_pass(tokens: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
            h = self._forward(tokens.reshape(-1), positions, block_cad)  # [rows * gamma, H]
            logits = self.model.compute_logits(h).view(rows, gamma, -1)  # [rows, gamma, V]
            h = h.view(rows, gamma, -1)
            if self.shift:  # column j - 1 predicts block token j
                logits = torch.cat([first[0][:, None], logits[:, :-1]], dim=1)
                h = torch.cat([first[1][:, None], h[:, :-1]], dim=1)
            logits = logits.float()
            logits[..., self.mask_id] = -torch.inf  # never draft the mask
            logits[..., self.vocab_limit:] = -torch.inf
            return logits, h

        active = torch.ones(rows, dtype=torch.bool, device=self.device)
        if lengths is None:
            return denoise(one_pass, active, gamma, self.steps, self.mask_id)
        return denoise(one_pass, active, gamma, self.steps, self.mask_id, features=True, generated=lengths[0],
                       max_new_tokens=lengths[1], dataset="code")

    def _skip_rounds(self, block: DraftBlock, start: torch.Tensor, table: torch.Tensor,
                     counted: torch.Tensor) -> DraftBlock:
        """Verifier skipping: rows the policy lets skip commit ``x_1..x_K^`` and draft again."""
        batch = block.draft_token_ids.shape[0]
        policy = self.policy
        if self.scorer is None:  # raw confidence: most steps end here, before any per-request work
            K_hat = policy.feasible_prefix(block.confidence, block.num_draft_tokens)  # [batch]
            if not bool(((K_hat > 0) & (K_hat >= policy.K_min) & counted).any()):
                return block
        eligible = counted & torch.tensor([request_gate_serves(self._runner.requests[r])
                                           for r in self._runner.input_batch.req_ids[:batch]], device=self.device)
        drafts = block.draft_token_ids.clone()  # [batch, gamma]: what each row hands the target
        rows = torch.nonzero(eligible).view(-1)  # rows still deciding
        cur, start = _take(block, rows), start[rows]
        generated = self._generated(counted)[rows]
        max_tokens = self._max_tokens(batch)[rows]
        unverified = torch.zeros_like(rows)  # D
        while rows.numel():
            scores = cur.confidence if self.scorer is None else self.scorer(cur)  # [rows, gamma]
            K_hat = policy.feasible_prefix(scores, cur.num_draft_tokens)  # [rows]
            guards = guard_flags(cur.draft_token_ids, scores, K_hat, self.special, max_tokens - generated,
                                 num_draft_tokens=cur.num_draft_tokens)
            decision = policy.decide(K_hat, unverified, guards)
            drafts[rows] = cur.draft_token_ids
            skip = decision.skip
            if not bool(skip.any()):
                break
            rows, K, x = rows[skip], K_hat[skip], cur.draft_token_ids[skip]  # the skipping rows
            for r, k, tokens in zip(rows.tolist(), K.tolist(), x.tolist()):
                self.skipped.setdefault(r, []).append(tokens[:k])
            self.counters.skipped_rounds += rows.numel()
            self.counters.skipped_tokens += int(K.sum())
            # A causal pass over the skipped tokens, then the next block after them.
            start, generated, max_tokens = start[skip], generated[skip] + K, max_tokens[skip]
            unverified = decision.unverified_after[skip]
            lengths = (torch.arange(x.shape[1], device=self.device)[None, :] < K[:, None])  # [rows, gamma]
            positions = (start[:, None] + self._offsets[None, :])[lengths]  # [sum K]
            prefix_cad = self._attn_metadata(positions, K, start + K, table[rows], causal=True)
            h = self._forward(x[lengths], positions, prefix_cad)  # [sum K, H]
            last = h[torch.cumsum(K, 0) - 1]  # [rows, H]: at each row's last skipped token
            start = start + K
            cur = self._draft(last, start, table[rows], (generated, max_tokens) if self.scorer is not None else None)
            self.counters.draft_blocks += rows.numel()
        return DraftBlock(drafts, block.num_draft_tokens, block.confidence, block.reveal_step)

    # -- vLLM plumbing -------------------------------------------------------------------------

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 cad: CommonAttentionMetadata) -> torch.Tensor:  # [num_tokens, hidden]
        """One drafter pass with ``cad``'s attention (causal or not) and KV slots."""
        _, per_layer = self.build_per_group_and_layer_attn_metadata(cad)
        slots = {name: cad.slot_mapping for name in self._draft_attn_layer_names}
        with set_forward_context(per_layer, self.vllm_config, num_tokens=input_ids.shape[0], slot_mapping=slots):
            return self.model(input_ids=input_ids.to(torch.int32), positions=positions, inputs_embeds=None)

    def _attn_metadata(self, positions: torch.Tensor, query_lens: torch.Tensor, seq_lens: torch.Tensor,
                       table: torch.Tensor, causal: bool) -> CommonAttentionMetadata:
        """Metadata of a pass over ``positions`` (rows' queries back to back, ``query_lens`` each)
        reading each row's KV up to ``seq_lens``; slots past max_model_len write nowhere."""
        rows = query_lens.shape[0]
        row_of = torch.repeat_interleave(torch.arange(rows, device=self.device), query_lens)  # [num_tokens]
        clamped = positions.clamp(max=self.max_model_len - 1)
        block_index = (clamped // self.block_size).clamp(max=table.shape[1] - 1)
        slots = table[row_of, block_index].to(torch.int64) * self.block_size + clamped % self.block_size
        slots = slots.masked_fill(positions >= self.max_model_len, PADDING_SLOT_ID)
        query_start = torch.zeros(rows + 1, dtype=torch.int32)
        query_start[1:] = torch.cumsum(query_lens.cpu(), 0)
        seq_lens = seq_lens.clamp(max=self.max_model_len).to(torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=query_start.to(self.device), query_start_loc_cpu=query_start, seq_lens=seq_lens,
            num_reqs=rows, num_actual_tokens=int(positions.shape[0]), max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()), block_table_tensor=table, slot_mapping=slots, causal=causal)

    def _counted_rows(self, batch: int) -> torch.Tensor:  # [batch] bool
        """Rows whose sample this step counts (not a prompt chunk still being prefilled)."""
        discard = torch.from_numpy(self._runner.discard_request_mask.np[:batch].copy())
        return ~discard.to(self.device)

    def _generated(self, counted: torch.Tensor) -> torch.Tensor:  # [batch] int64
        """Tokens each request will have generated once this step's tokens are committed."""
        batch = counted.shape[0]
        before = [len(self._runner.requests[r].output_token_ids) for r in self._runner.input_batch.req_ids[:batch]]
        valid = getattr(self, "_valid_count", None)
        now = valid[:batch].to(torch.int64) if valid is not None else counted.long()
        return torch.tensor(before, device=self.device) + torch.where(counted, now, 0)

    def _max_tokens(self, batch: int) -> torch.Tensor:  # [batch] int64
        requests, ids = self._runner.requests, self._runner.input_batch.req_ids[:batch]
        return torch.tensor([requests[r].sampling_params.max_tokens or self.max_model_len for r in ids],
                            device=self.device)


def _take(block: DraftBlock, rows: torch.Tensor) -> DraftBlock:
    """The rows ``rows`` of a block."""
    pick = lambda t: None if t is None else t[rows]  # noqa: E731
    return DraftBlock(block.draft_token_ids[rows], block.num_draft_tokens[rows], block.confidence[rows],
                      block.reveal_step[rows], pick(block.hidden), pick(block.scalars))


class SDDRunnerMixin:
    """Mixed into the live model runner of mode ``sdd`` (``worker.install``)."""

    prove: ProveEngineConfig

    def _bookkeeping_sync(self, scheduler_output, *args, **kwargs):
        """vLLM's bookkeeping, then the skipped tokens appended after each request's sampled ones
        (the runner's token table and the output both; the drafter has already read them)."""
        result = super()._bookkeeping_sync(scheduler_output, *args, **kwargs)
        valid_sampled_token_ids = result[3]
        self._prove_skipped = {}
        batch = self.input_batch
        for row, rounds in self.drafter.skipped.items():
            if not valid_sampled_token_ids[row]:
                continue
            start = int(batch.num_tokens_no_spec[row])
            tokens = [t for r in rounds for t in r][: max(0, self.max_model_len - start)]
            end = start + len(tokens)
            batch.token_ids_cpu[row, start:end] = tokens
            batch.is_token_ids[row, start:end] = True
            batch.num_tokens_no_spec[row] = end
            req_id = batch.req_ids[row]
            at = len(self.requests[req_id].output_token_ids)
            for r in rounds:  # one audit entry per skipped round
                self.drafter.counters.skips.append((external_id(req_id), at, len(r)))
                at += len(r)
            self.requests[req_id].output_token_ids.extend(tokens)
            valid_sampled_token_ids[row].extend(tokens)
            self._prove_skipped[req_id] = len(tokens)
        return result

    def sample_tokens(self, grammar_output):
        output = super().sample_tokens(grammar_output)
        if isinstance(output, ModelRunnerOutput):
            setattr(output, SKIPPED_ATTR, getattr(self, "_prove_skipped", {}))
        self._prove_skipped = {}
        return output

    def _sample(self, logits, spec_decode_metadata) -> SamplerOutput:
        """vLLM's sampler (strict verification); ``lenience`` / ``topk`` re-decide the windows of
        greedy requests from the same logits with the core's rule."""
        md = spec_decode_metadata
        num_reqs = self.input_batch.num_reqs
        self.drafter.counters.verified_blocks += int((~self.discard_request_mask.np[:num_reqs]).sum())
        if md is None or self.prove.rule not in ("lenience", "topk"):
            return super()._sample(logits, md)
        sampled = super()._sample(logits.clone(), md)  # vLLM may write into the logits
        served = [i for i, r in enumerate(self.input_batch.req_ids[: len(md.num_draft_tokens)])
                  if r is not None and request_gate_serves(self.requests[r]) and md.num_draft_tokens[i] > 0]
        if not served:
            return sampled
        x, n, window = _windows(logits, md)  # [reqs, S], [reqs], [reqs, S + 1, V]
        if self.prove.rule == "lenience":
            verdict = lenient_accept(x, n, window, self.prove.lenience)
        else:
            verdict = topk_accept(x, n, window, self.prove.top_k)
        strict = strict_greedy(x, n, window)
        token_ids = sampled.sampled_token_ids.clone()  # [reqs, S + 1]
        relaxed = gate.sampled_token_ids(verdict, md.max_spec_len).to(token_ids.dtype)
        rows = torch.tensor(served, device=token_ids.device)
        token_ids[rows] = relaxed[rows]
        for i in served:
            self.drafter.counters.relaxed.append(int(verdict.num_accepted[i]))
            self.drafter.counters.strict.append(int(strict.num_accepted[i]))
        logprobs = sampled.logprobs_tensors  # served requests ask for none (request_gate_serves)
        return SamplerOutput(sampled_token_ids=token_ids, logprobs_tensors=logprobs)


def external_id(req_id: str) -> str:
    """The request id the user gave (vLLM appends ``-`` and 8 random characters, input_processor.py:371)."""
    return req_id.rsplit("-", 1)[0]


def _windows(logits: torch.Tensor, md) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per request: drafts ``[reqs, S]`` (padded with 0), their number, and the window logits
    ``[reqs, S + 1, V]`` (rows past a request's drafts repeat its bonus row; the rules read
    only the first ``n + 1``)."""
    reqs, S = len(md.num_draft_tokens), md.max_spec_len
    n = torch.tensor(md.num_draft_tokens, device=logits.device)  # [reqs]
    first = md.cu_num_sampled_tokens.to(logits.device) - (n + 1)  # [reqs] first logits row
    offsets = torch.arange(S + 1, device=logits.device)  # [S + 1]
    index = first[:, None] + torch.minimum(offsets[None, :], n[:, None])  # [reqs, S + 1]
    window = logits[index]  # [reqs, S + 1, V]
    first_draft = md.cu_num_draft_tokens.to(logits.device) - n  # [reqs]
    draft_index = (first_draft[:, None] + offsets[None, :S]).clamp(max=max(0, md.draft_token_ids.shape[0] - 1))
    x = torch.where(offsets[None, :S] < n[:, None], md.draft_token_ids[draft_index].to(torch.int64), 0)
    return x, n, window


def sdd_runner_class(runner_cls: type) -> type:
    """``runner_cls`` with ``SDDRunnerMixin`` (one class per runner class)."""
    return type(f"ProveSDD{runner_cls.__name__}", (SDDRunnerMixin, runner_cls), {})


class SDDScheduler(WholeSeededSteps, Scheduler):
    """vLLM's synchronous scheduler, with the look-ahead and the accounting of skipped tokens
    (and seeded sampling requests scheduled whole, ``seeded.WholeSeededSteps``).

    - Look-ahead: a block needs ``gamma + 1`` slots past the last scheduled token (the bonus
      token's block when every draft is accepted), a skip chain ``S_max + gamma`` more.
    - A request that skipped ``K`` tokens in a step with drafts returns ``a + 1 + K`` tokens;
      vLLM would count the ``K`` as accepted drafts (computed, and in the acceptance counters).
      They are not computed: the target reads them at the request's next step.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        settings = engine_settings(self.vllm_config)
        extra = settings.s_max + settings.block_size if settings.rule == "skip" else 0
        self.num_lookahead_tokens = max(self.num_lookahead_tokens, settings.block_size + 1 + extra)
        self._skipped_now: dict[str, int] = {}

    def update_from_output(self, scheduler_output, model_runner_output):
        skipped = getattr(model_runner_output, SKIPPED_ATTR, None) or {}
        spec = scheduler_output.scheduled_spec_decode_tokens
        self._skipped_now = {r: k for r, k in skipped.items() if spec.get(r)}
        held = []  # per-request acceptance histograms: room for vLLM's count, then moved back by K
        for req_id, k in self._skipped_now.items():
            metrics = getattr(self.requests.get(req_id), "spec_decode_metrics", None)
            if metrics is not None:
                held.append((metrics, list(metrics.histogram), k))
                metrics.histogram.extend([0] * k)
        try:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
        finally:
            for metrics, before, k in held:
                _unshift_histogram(metrics, before, k)
        for req_id, k in self._skipped_now.items():
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished():
                request.num_computed_tokens -= k  # the target has not read them yet
        self._skipped_now = {}
        return outputs

    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                 num_invalid_spec_tokens, request_id):
        return super().make_spec_decoding_stats(
            spec_decoding_stats, num_draft_tokens, num_accepted_tokens - self._skipped_now.get(request_id, 0),
            num_invalid_spec_tokens, request_id)


def _unshift_histogram(metrics, before: list[int], k: int) -> None:
    """vLLM observed ``a + k`` accepted drafts; make it ``a`` (the verified ones)."""
    grown = [i for i, count in enumerate(metrics.histogram) if count != (before[i] if i < len(before) else 0)]
    del metrics.histogram[len(before):]
    for i in grown:
        metrics.histogram[i - k] += 1
        if i < len(before):
            metrics.histogram[i] -= 1
    if metrics.per_step_accepted:
        metrics.per_step_accepted[-1] -= k
