"""Seeded sampling that gives the same text alone and in any batch, with drafts.

A request with a ``seed`` that samples draws every random number from its own generator:
its drafts (``proposers._sample_draft_tokens``), then in the rejection sampler one uniform per
scheduled draft, one recovered-token row and the bonus token's row. Its text is therefore a
function of its seed *and of how many drafts each of its steps verifies*. Alone, every step
verifies all ``K`` drafts. In a full batch vLLM cuts a request's drafts when the step's budget
runs out (``scheduler.py:705-716``: each drafting request takes its tokens plus
``max_num_new_slots_for_drafting`` input slots, so with ProVe-lossless' ``K = 8`` only seven
decoding requests fit a 128-token step and the eighth gets its one token without drafts): that
step verifies fewer drafts, draws fewer numbers, and the text departs from the one alone.

``WholeSeededSteps`` (a mixin for vLLM's ``Scheduler``) schedules such a request with all of its
drafts or not at all. Before vLLM's loop over the running requests it moves the seeded,
drafting ones to the front, in their order, and holds back for this step each one whose whole
step (``1 + K`` tokens and the drafting slots) no longer fits the budget left by the ones
before it. A held request keeps its drafts and is scheduled whole at a later step: waiting
draws nothing, so its text is unchanged. The other requests keep vLLM's order behind them and
take what is left, cut as usual. (A step too large for even an empty batch is cut alike alone
and in a batch: such a request keeps vLLM's order and rules.)

A held request must also find its draft probabilities when it is verified: vLLM keeps them for
one step only, so the model runner keeps those of unscheduled requests (``KeepDraftProbsMixin``).

What this does not cover: a request that vLLM preempts between drafting and verification
(KV-cache pressure) has drawn draft noise it never verifies, so its stream moves on; at the
front of the running list a seeded request is the last one preempted.
"""

from __future__ import annotations

import torch
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_prove.engine.proposers import SAMPLING_EPS


def seeded_sampling(request) -> bool:
    """A request whose text is fixed by its seed: it samples, from its own generator."""
    params = request.sampling_params
    return params is not None and params.seed is not None and params.temperature > SAMPLING_EPS


class WholeSeededSteps:
    """Schedule a seeded, sampling request with all of its drafts or not at all (module docstring).

    Put it before vLLM's ``Scheduler`` in the bases; it runs at the start of ``schedule`` and
    needs a synchronous scheduler (no output placeholders)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seeded_ids: set[str] = set()  # the requests that sample from their own seed (none: nothing to do)

    def add_request(self, request) -> None:
        super().add_request(request)
        if seeded_sampling(request):
            self.seeded_ids.add(request.request_id)

    def _free_request(self, request, *args, **kwargs):
        self.seeded_ids.discard(request.request_id)
        return super()._free_request(request, *args, **kwargs)

    def schedule(self, *args, **kwargs):
        if self.seeded_ids:
            self._seat_seeded_requests()
        return super().schedule(*args, **kwargs)

    def _seat_seeded_requests(self) -> None:
        """Move the seeded, drafting requests to the front of ``self.running`` and hold back for
        this step those whose whole step does not fit: vLLM schedules a running request
        ``min(num_new_tokens, token_budget, input_budget - draft_slots)`` tokens and then
        charges ``num_new_tokens + draft_slots`` input slots (``scheduler.py:705-716, 856-857``).
        A held request stays in ``self.running`` (the ``max_num_seqs`` count) and is passed over
        by vLLM's own loop through ``next_decode_eligible_step`` (``scheduler.py:680``, the
        knob vLLM's diffusion scheduler uses): the step about to start is ``current_step + 1``."""
        seeded = [r for r in self.running if r.spec_token_ids and seeded_sampling(r)]
        if not seeded:
            return
        spec = self.vllm_config.speculative_config
        draft_slots = spec.max_num_new_slots_for_drafting if spec is not None else 0
        token_total, input_total = self.max_num_scheduled_tokens, self.scheduler_config.max_num_batched_tokens
        token_budget, input_budget = token_total, input_total
        moved = []
        for request in seeded:
            need = min(request.num_tokens_with_spec - request.num_computed_tokens,
                       self.max_model_len - request.num_computed_tokens - self.num_sampled_tokens_per_step)
            if need > token_total or need + draft_slots > input_total:
                continue  # never fits a step, alone either: it stays in vLLM's order and rules
            moved.append(request)
            if need <= token_budget and need + draft_slots <= input_budget:
                token_budget -= need
                input_budget -= need + draft_slots
            else:
                request.next_decode_eligible_step = max(request.next_decode_eligible_step, self.current_step + 2)
        ids = {id(r) for r in moved}
        self.running[:] = moved + [r for r in self.running if id(r) not in ids]


class SeededScheduler(WholeSeededSteps, Scheduler):
    """vLLM's synchronous ``Scheduler``, with whole steps for seeded sampling requests: the
    scheduler of ProVe-lossless and ``sd`` with ``adaptive: false`` wherever vLLM schedules
    synchronously (on CPU, or with ``async_scheduling=False``)."""


class KeepDraftProbsMixin:
    """Mixed into the model runner of the sampling modes: a request's draft probabilities live until
    its drafts are verified, not for one step only.

    vLLM keeps the draft probabilities of one step for the next (``gpu_model_runner.py:5019-5022``)
    and looks each verified request up there (``_get_spec_decode_draft_probs``, l.4719-4746). A
    request with drafts that is not scheduled in that next step (held back whole above, or past
    the token budget) loses them, and the step that verifies it later falls back, for the whole
    batch, to one-hot drafts: still exact, but with a lower acceptance, and a seeded request
    then draws its numbers into other decisions than alone. Here the rows of such requests are
    kept (``[K, vocab]`` each, with the draft tokens they belong to, only while they wait) and
    served when those very tokens are verified.

    A kept row is served only for the tokens it was drafted with: under vLLM's asynchronous
    scheduler a request that missed a step is verified on placeholder drafts (token 0,
    ``gpu_model_runner.py:3309``), not on its own, and the rejection test of a token against the
    probabilities of another draft would be biased. Such drafts, and any request whose draft
    probabilities are gone, are verified as one-hot drafts, request by request: accepting a draft
    ``x`` with probability ``p(x)`` and otherwise sampling ``p`` without ``x`` gives exactly ``p``
    whatever distribution ``x`` came from."""

    def _sample(self, logits, spec_decode_metadata):
        # This step's verification has read last step's probabilities (below); vLLM drops them
        # after it (gpu_model_runner.py:4355), so the rows of the requests not in this step go aside.
        output = super()._sample(logits, spec_decode_metadata)
        kept = self.__dict__.setdefault("_prove_kept_draft_probs", {})
        if not kept and self._draft_probs is None:
            return output  # nothing waits, nothing to keep (every all-greedy step)
        batch = set(self.input_batch.req_ids)
        for req_id in [r for r in kept if r in batch or r not in self.requests]:
            del kept[req_id]  # verified in this step (or its drafts dropped), or finished
        drafts = self._draft_token_ids  # [num_reqs, K]: the probabilities' rows (gpu_model_runner.py:5006-5023)
        if self._draft_probs is not None and self._draft_prob_req_ids is not None and drafts is not None:
            for row, req_id in enumerate(self._draft_prob_req_ids):
                if req_id not in batch and req_id in self.requests:
                    tokens = torch.as_tensor(drafts[row], device=self._draft_probs.device)  # [K]
                    kept[req_id] = (tokens.clone(), self._draft_probs[row].clone())  # [K], [K, vocab]
        return output

    def _get_spec_decode_draft_probs(self, spec_decode_metadata):
        kept = getattr(self, "_prove_kept_draft_probs", None)
        if not kept:
            return super()._get_spec_decode_draft_probs(spec_decode_metadata)
        current = {} if self._draft_probs is None or self._draft_prob_req_ids is None else {
            req_id: i for i, req_id in enumerate(self._draft_prob_req_ids)}
        _, some_row = next(iter(kept.values()))
        verified = spec_decode_metadata.draft_token_ids  # [total drafts], request after request
        rows, start = [], 0
        for req_id, num_draft in zip(self.input_batch.req_ids, spec_decode_metadata.num_draft_tokens):
            if num_draft == 0:
                continue
            tokens, start = verified[start : start + num_draft], start + num_draft
            if req_id in current:
                rows.append(self._draft_probs[current[req_id], :num_draft])
            elif req_id in kept and torch.equal(kept[req_id][0][:num_draft], tokens.to(kept[req_id][0].dtype)):
                rows.append(kept[req_id][1][:num_draft])
            else:  # not the drafts the probabilities belong to, or none kept: a one-hot (exact) test
                rows.append(torch.nn.functional.one_hot(tokens.long(), some_row.shape[-1]).to(some_row.dtype))
        return torch.cat(rows, dim=0).contiguous() if rows else None


def keep_draft_probs_runner_class(runner_cls: type) -> type:
    """``runner_cls`` with ``KeepDraftProbsMixin`` (one class per runner class)."""
    return type(f"ProveKeepDraftProbs{runner_cls.__name__}", (KeepDraftProbsMixin, runner_cls), {})
