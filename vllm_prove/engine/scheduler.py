"""The gated modes' window accounting in vLLM's scheduler (docs/METHODS.md §3: the next propose
pass reads ``committed tokens + B - 1 masks``, and the cache holds committed tokens as real).

vLLM's scheduler keeps, per request, ``num_computed_tokens`` against
``num_tokens_with_spec`` (prompt + output + draft tokens) and schedules the difference
(``vllm/v1/core/sched/scheduler.py:591``). ``ProveScheduler`` makes each request's drafts
the ``B - 1`` masks of its next window and keeps three invariants:

1. **Committed tokens are re-fed as real tokens.** A window ``[u, mask x (B-1)]`` that
   commits ``y_1..y_a`` left mask KV at the positions of ``y_1..y_{a-1}``; vLLM counts them
   as computed (``num_accepted = a - 1``, l.2116-2126). ``update_from_output`` rolls
   ``num_computed_tokens`` back by ``a - 1``, so the next step schedules
   ``[y_1..y_a, mask x (B-1)]``: the paper's next window, at no extra pass::

       positions:     P-1 | P    P+1  ... P+B-2      P-1 | P   ... P+a-1 | P+a ... P+a+B-2
       step n:        u   | m_1  m_2  ... m_{B-1}        |               |
       step n+1:                                     (done)| y_1 ... y_a | m_1 ... m_{B-1}

2. **Every block a request commits comes from a full window.** vLLM schedules no drafts for
   a request it admits from the waiting queue (new, or resumed after preemption,
   l.1100-1160), and cuts drafts when the token budget runs short (l.705-716). A chunk that
   would end at the last known token without its full window therefore stops one token
   short (``_reserve_prefill_lookahead``), and the next step schedules ``[u, masks]``. A
   request admitted with a single uncomputed token gets its masks in this very step
   (``_update_after_schedule``), out of a budget of ``B - 1`` tokens held back for it.
3. **Mask KV is never served as context.** Masks sit past ``request.num_tokens``, so no
   block holding them is hashed for prefix caching (``kv_cache_manager.py:606-616``) and a
   preempted request recomputes only real tokens; the catch-up rewrites every mask slot
   before a later pass reads it.

The metrics follow: vLLM counts ``num_draft_tokens = B - 1`` and ``num_accepted = a - 1``
per window, so its mean acceptance length is committed tokens per cycle.

A request the gate cannot decode exactly (``requests.gate_serves`` is False: temperature > 0,
logprobs, penalties, ...) gets no window: it is scheduled by vLLM's own rules, one token per
step, and the runner samples it with vLLM's sampler in the same batch (the fallback path).
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from vllm_prove.engine.requests import request_gate_serves
from vllm_prove.engine.settings import engine_settings

# vLLM's placeholder draft for requests it pads to a uniform spec-decode batch
# (scheduler.py:1371-1375); in the gated modes it becomes a mask.
PADDING_DRAFT_TOKEN_ID = -1
# _reserve_prefill_lookahead's answer "schedule nothing for this request in this step"
# (the running loop skips it, l.766; the waiting loop stops admitting, l.1175).
SCHEDULE_NOTHING = 0


class ProveScheduler(Scheduler):
    """vLLM's synchronous ``Scheduler`` with the window accounting of the gated ProVe modes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        settings = engine_settings(self.vllm_config)
        if settings is None or not settings.mode.gated:
            raise RuntimeError("ProveScheduler serves the gated ProVe modes only; this engine has "
                               f"{'no ProVe settings' if settings is None else 'mode ' + settings.mode.value!r}")
        self.prove = settings
        self.window = [settings.mask_token_id] * settings.num_speculative_tokens  # B - 1 masks
        # Token budget held back so one request admitted with a single uncomputed token can
        # get its masks in the same step (invariant 2); the runner's buffers keep the full size.
        self.max_num_scheduled_tokens -= len(self.window)
        self._window_reserve_taken = False

    def window_size(self, request) -> int:
        """Masks a window of ``request`` holds: ``B - 1``, fewer near ``max_model_len`` (l.717);
        0 for a request the gate does not serve (the fallback path: no windows)."""
        if not request_gate_serves(request):
            return 0
        return min(len(self.window), self.max_model_len - 1 - request.num_tokens)

    def schedule(self, *args, **kwargs):
        self._window_reserve_taken = False
        return super().schedule(*args, **kwargs)

    def _reserve_prefill_lookahead(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Never end a chunk at the last known token without the full window (invariant 2)."""
        num_new_tokens = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        remaining = request.num_tokens - num_computed_tokens - num_new_tokens
        if remaining > 0 or self.window_size(request) <= 0:
            return num_new_tokens  # a catch-up chunk, or no room for masks: vLLM's own rules
        if request.status == RequestStatus.RUNNING:
            if -remaining >= self.window_size(request):
                return num_new_tokens  # the full window fits
            return request.num_tokens - num_computed_tokens - 1  # stop before u (maybe nothing now)
        if remaining < 0:
            return num_new_tokens  # vLLM padded a new request to 1 + K tokens: a full window
        if num_new_tokens >= 2:
            return num_new_tokens - 1  # u and its window come next step, as a running request
        if self._window_reserve_taken:
            return SCHEDULE_NOTHING  # admitted next step, when the reserve is free again
        self._window_reserve_taken = True
        return num_new_tokens  # _update_after_schedule appends its masks

    def _update_after_schedule(self, scheduler_output) -> None:
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for req_id, draft_token_ids in spec_tokens.items():
            if PADDING_DRAFT_TOKEN_ID in draft_token_ids:
                spec_tokens[req_id] = [self.window[0] if t == PADDING_DRAFT_TOKEN_ID else t for t in draft_token_ids]
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            # num_computed_tokens is advanced by super() below; here it is the chunk's start.
            if req_id in spec_tokens or request.num_computed_tokens + num_tokens != request.num_tokens:
                continue
            self._append_window(scheduler_output, req_id, request)
        super()._update_after_schedule(scheduler_output)

    def _append_window(self, scheduler_output, req_id: str, request) -> None:
        """Schedule ``request``'s masks after its last known token, in the held-back budget."""
        size = self.window_size(request)
        capacity = self.scheduler_config.max_num_batched_tokens  # the runner's buffer size
        if size <= 0 or scheduler_output.total_num_scheduled_tokens + size > capacity:
            return  # at max_model_len: the request ends with plain steps
        # The masks' KV slots exist: every allocation reserved num_lookahead_tokens = B - 1
        # more (vllm/config/vllm.py:636, scheduler.py:1261).
        scheduler_output.scheduled_spec_decode_tokens[req_id] = self.window[:size]
        scheduler_output.num_scheduled_tokens[req_id] += size
        scheduler_output.total_num_scheduled_tokens += size

    def update_from_output(self, scheduler_output, model_runner_output):
        sampled_token_ids = model_runner_output.sampled_token_ids
        req_id_to_index = model_runner_output.req_id_to_index
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for req_id in scheduler_output.scheduled_spec_decode_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished() or req_id not in req_id_to_index or not sampled_token_ids:
                continue
            num_committed = len(sampled_token_ids[req_id_to_index[req_id]])
            if num_committed > 1:
                request.num_computed_tokens -= num_committed - 1  # invariant 1: re-feed y_1..y_a
        for request in self.running:  # the next window's drafts; none on the fallback path
            request.spec_token_ids = list(self.window) if request_gate_serves(request) else []
        return outputs

    def update_draft_token_ids(self, draft_token_ids) -> None:
        """Ignore the runner's drafts: the window is the scheduler's (``update_from_output``)."""
