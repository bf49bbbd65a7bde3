"""Load-adaptive speculation depth inside vLLM's scheduler (docs/METHODS.md §9).

``AdaptiveScheduler`` is vLLM's synchronous ``Scheduler`` with one decision per engine step,
taken by the engine-free ``core.adaptive.DepthController``; this module only measures and
applies. Per step:

1. **Decide** (start of ``schedule``): for every decoding request the verify depth ``K_r`` and
   for the whole batch the draft depth ``D`` of the next step. While a seeded request that samples
   runs, the whole batch takes the full depth (the fixed depth's behaviour): its generator is
   drawn per draft, so its text would otherwise depend on the load.
2. **Apply**: a request's drafts are cut to ``K_r`` before vLLM schedules them (vLLM cuts drafts
   the same way when the token budget runs short, ``scheduler.py:861-876``; the rejection
   sampler and the draft probabilities follow per request, ``gpu_model_runner.py:4719``), and
   ``SchedulerOutput.num_spec_tokens_to_schedule = D`` makes the drafter draft ``D`` tokens per
   request after this step's verification: vLLM's dynamic-SD field, read by every drafter's
   ``propose(num_speculative_tokens=...)`` (``gpu_model_runner.py:4763``). ``D = 0`` skips
   ProVe-lossless' mask pass; vLLM's draft model still re-reads the verified rows (its own KV).
3. **Measure** (while the next step's model pass runs): the step's cycle, from the start of its
   ``schedule`` to the start of the next one: model execution, sampling and drafting, the engine's draft
   fetch (``EngineCore.post_step``: a round trip that only speculative steps pay, ``executor``)
   and its loop between steps (outputs handed to the front end, new requests read: a cost per
   step that speculation pays fewer times per token; on the CPU 0.04-0.13 ms a plain step,
   0.5-1.4 ms a speculative one with the fetch, reported as ``loop_gap_ms``; the last step
   before the engine idles ends at its ``update_from_output``), with its shape (requests,
   target rows, drafter passes and rows) and the tokens it committed -> the online cost fit and
   the speculation guard; each verification's drafted and accepted counts -> the acceptance
   estimates (at once, in ``update_from_output``). The step's observation is fed in
   ``get_grammar_bitmask``, which ``EngineCore.step`` calls between sending a step to the workers
   and waiting for its result (``core.py:668-674``): the engine core would spend that time
   polling, so the measurement costs no step any time (the decision it informs is the step after
   next: one step later than at the start of ``schedule``, where it took ~0.03 ms of every
   step's critical path at 32 in flight on the CPU). The same window makes the next decision's
   cost fit and solve ahead (``DepthController.prepare``: every 8 steps while speculating, and for
   each new set of requests; ~0.1 ms a step at one request in flight).

In ProVe-lossless a step with ``D = 0`` also skips vLLM's drafter plumbing in the model runner
(``PlainStepRunnerMixin``, installed by ``worker.install``).

Nothing here changes what a lossless mode commits: vLLM's verification decides every token, and
the mask KV a shorter verification leaves behind lies past the next verification's start
(``proposers.SelfMaskProposer``), so the output is greedy AR's under any schedule
(``tests/engine/test_engine_lossless.py`` drives random schedules).

Observability: the decisions and the cost estimates are logged every ``LOG_EVERY_S`` seconds, vLLM's
spec-decode counters carry the mean verify depth (``num_draft_tokens / num_drafts``), and
``LLM.collective_rpc("prove_adaptive_summary")`` returns ``prove_adaptive_summary()`` as of the
call: the plug-in's executors answer it from this scheduler (``executor.serve_summary``); on any
other executor (Ray) every ``SchedulerOutput`` carries ``DepthController.step_summary()`` to the
workers (attribute ``SUMMARY_ATTR``; the decision counts current, the estimates refreshed every
16 steps), which answer with the latest. ``LLM.collective_rpc("prove_step_log", args=(True,))``
(the plug-in's executors only) starts a log of every observed step's load, shape, cycle and
committed tokens (``STEP_LOG_COLUMNS``) and returns the rows since the last call: traces for a
replay of the controller (``scripts/record_step_traces.py``, ``tests/core/traces/``).

A plain step's own work here is kept to a few dict lookups per request: on the CPU the engine
core's Python runs cold after every model pass, and at 32 in flight each 0.05 ms of it is ~1% of
a plain step on the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch
from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_prove.config import EngineMode
from vllm_prove.core.adaptive import DepthController, DraftKind, StepShape
from vllm_prove.engine.executor import serve_summary
from vllm_prove.engine.seeded import WholeSeededSteps
from vllm_prove.engine.settings import engine_settings

logger = init_logger(__name__)
LOG_EVERY_S = 30.0
SUMMARY_ATTR = "prove_adaptive_summary"  # SchedulerOutput attribute read by the ProVe workers
# the fields of a ``prove_step_log`` row
STEP_LOG_COLUMNS = ("load", "requests", "rows", "spec_requests", "draft_depth", "draft_passes", "draft_rows",
                    "draft_requests", "prefill_rows", "seconds", "committed")


class AdaptiveScheduler(WholeSeededSteps, Scheduler):
    """vLLM's synchronous ``Scheduler`` deciding each step's speculation depths (module docstring);
    a seeded request that samples keeps the full depth and is scheduled whole (``seeded``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        settings = engine_settings(self.vllm_config)
        if settings is None or not settings.adaptive_on:  # never on in a gated mode (ProveEngineConfig)
            raise RuntimeError("AdaptiveScheduler serves ProVe modes 'lossless' and 'sd' with adaptive on; this engine "
                               f"has {'no ProVe settings' if settings is None else settings.model_dump(mode='json')}")
        kind = DraftKind.PARALLEL if settings.mode is EngineMode.LOSSLESS else DraftKind.SEQUENTIAL
        self.depth = DepthController(self.num_spec_tokens, kind, policy=settings.adaptive_policy,
                                     seed=self.vllm_config.model_config.seed or 0)
        # vLLM pads a request admitted with one uncomputed token (a one-token prompt, a prefix hit)
        # to the full depth with placeholder drafts (-1, always rejected) so that CUDA graphs see a
        # uniform decode batch (scheduler.py:1131-1153). Per-request depths have no uniform batch to
        # keep: the padding would cost num_spec_tokens rows for nothing and enter the acceptance
        # estimates as rejected drafts. vLLM skips it under its own dynamic depth, a batch-size
        # table; declaring one (the full depth at every size; ``schedule`` sets each step's
        # draft depth) turns it off.
        self.dynamic_sd_lookup = [self.num_spec_tokens] * (self.scheduler_config.max_num_seqs + 1)
        self._plan = None
        self._step_start = 0.0
        self._pending = None  # (shape, committed, load, decision, start, end) of the last step, until observed
        self._pending_end: float | None = None  # where its cycle ended (the next step's start), once known
        self._load, self._decided = 0, -1  # the load the step was decided at, and its decision's index
        self._last_log = time.monotonic()
        self._own_seconds = 0.0  # on the steps' critical path
        self._window_seconds = 0.0  # while the workers run a step (``get_grammar_bitmask``)
        self._loop_gap_ms: float | None = None  # the engine's time between a step's update and the next step (EWMA)
        self._ship_summary = not serve_summary(self)  # (an executor of the plug-in's asks this scheduler)
        self._step_log: list | None = None  # one row per observed step while on (``prove_step_log``)

    def schedule(self, *args, **kwargs):
        self._step_start = start = time.perf_counter()
        if self._pending is not None and self._pending_end is None:
            self._pending_end = start  # the last step's cycle ends where this one starts
        decoding = [r for r in self.running if r.num_output_tokens > 0]
        seeded = self.seeded_ids
        pinned = frozenset(r.request_id for r in self.running if r.request_id in seeded) if seeded else frozenset()
        load = self._load_now()
        self._plan = plan = self.depth.decide([r.request_id for r in decoding], pinned, load)
        # the load the decision judged and its index, for its observation
        self._load, self._decided = plan.load, self.depth.steps - 1
        depths = plan.depths
        for request in decoding:
            if request.spec_token_ids:  # (none after a step that drafted nothing)
                del request.spec_token_ids[depths[request.request_id]:]
        mid = time.perf_counter()
        output = super().schedule(*args, **kwargs)
        end = time.perf_counter()
        if output.total_num_scheduled_tokens:
            draft_depth = plan.draft_depth
            if pinned or (seeded and any(r in seeded for r in output.num_scheduled_tokens)):
                draft_depth = self.num_spec_tokens  # a seeded sampler runs or was admitted in this very step
            else:  # drafted for the load the next step verifies at (this step's prompts admitted)
                draft_depth = self.depth.draft_depth_for(len(self.running), draft_depth)
            output.num_spec_tokens_to_schedule = min(draft_depth, self.num_spec_tokens)
        if self._ship_summary:
            setattr(output, SUMMARY_ATTR, self.depth.step_summary() | self._timings())
        self._own_seconds += (mid - start) + (time.perf_counter() - end)
        return output

    def get_grammar_bitmask(self, scheduler_output):
        # (the workers run the step meanwhile: module docstring, step 3)
        start = time.perf_counter()
        if self._pending_end is not None:
            self._observe_pending(self._pending_end)
        if scheduler_output.total_num_scheduled_tokens and not self.seeded_ids:
            # the next decision's fit and solve, for the requests running now at the load now
            self.depth.prepare([r.request_id for r in self.running], self._load_now())
        self._window_seconds += time.perf_counter() - start
        return super().get_grammar_bitmask(scheduler_output)

    def _load_now(self) -> int:
        """The load a step runs: the running requests and those it can admit from the queue."""
        return min(sum(self.get_request_counts()), self.max_num_running_reqs)

    def prove_adaptive_summary(self) -> dict:
        """``DepthController.summary()`` as of now (the fit in use), with ``overhead_ms`` (the
        controller's own time per decided step on the steps' critical path: deciding, applying,
        reading the step's output), ``window_ms`` (its time per step while the workers run the
        step: measuring) and ``loop_gap_ms`` (the engine's time between a step's end and the next
        step)."""
        return self.depth.summary(refit=False) | self._timings()

    def prove_step_log(self, on: bool = True) -> list | None:
        """Record one row per observed step (``STEP_LOG_COLUMNS``: the load it was decided at, its
        shape, its cycle in seconds and the tokens it committed, -1 for none) for a trace-replay
        simulator (``scripts/record_step_traces.py``); returns what was recorded so far and, with
        ``on`` False, stops (as ``ProveWorker.prove_record_drafts``)."""
        records = self._step_log
        self._step_log = [] if on else None
        return records

    def _timings(self) -> dict:
        steps = max(1, self.depth.steps)
        return {"overhead_ms": round(1000 * self._own_seconds / steps, 4),
                "window_ms": round(1000 * self._window_seconds / steps, 4),
                "loop_gap_ms": None if self._loop_gap_ms is None else round(self._loop_gap_ms, 4)}

    def update_from_output(self, scheduler_output, model_runner_output):
        start = time.perf_counter()
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        spec = scheduler_output.scheduled_spec_decode_tokens
        # the verifications vLLM's spec-decode counters count (scheduler.py:2110-2118), read before
        # its update, which trims a request's sampled tokens in place at its stop (EOS, stop id,
        # max_tokens: scheduler.py:2508): read after it, a stop inside an accepted block would
        # count as rejected drafts
        verified = [(req_id, len(drafts), len(sampled[index[req_id]]) - 1) for req_id, drafts in spec.items()
                    if sampled and req_id in index and sampled[index[req_id]] and drafts
                    and (request := self.requests.get(req_id)) is not None and not request.is_finished()]
        if verified:  # (before vLLM's update frees the requests that finish: their rows go with them)
            ids, drafted, accepted = zip(*verified)
            self.depth.observe_verifications(list(ids), list(drafted), list(accepted))
        self._own_seconds += time.perf_counter() - start
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        start = time.perf_counter()
        total = scheduler_output.total_num_scheduled_tokens
        if total and self._plan is not None:
            if self._pending is not None:  # (a step whose window never came: ``get_grammar_bitmask``)
                self._observe_pending(self._pending_end or start)
            requests = len(scheduler_output.num_scheduled_tokens)
            num_spec = sum(len(d) for d in spec.values())
            extra_rows = total - requests - num_spec  # prefill chunks
            shape = StepShape.of(requests, num_spec, scheduler_output.num_spec_tokens_to_schedule, self.depth.kind,
                                 extra_rows=extra_rows, spec_requests=sum(1 for d in spec.values() if d))
            if scheduler_output.scheduled_new_reqs:  # (prompts begun here: the guard's price per prompt)
                shape = dataclasses.replace(shape, admitted=len(scheduler_output.scheduled_new_reqs))
                for new in scheduler_output.scheduled_new_reqs:
                    if new.sampling_params is not None and new.sampling_params.max_tokens:
                        self.depth.expect(new.sampling_params.max_tokens)
            committed = None
            if sampled and self._plan.depths:
                # what a step with decoding requests committed feeds the speculation guard (prefill
                # chunks riding along included); a step that only prefills (a prompt admitted to an
                # idle engine) costs the same in either regime and feeds only the cost fit
                committed = sum(map(len, sampled))  # (one entry per scheduled request, as req_id_to_index)
            # observed while the next step runs (its cycle, to the next step's start, includes the
            # engine's draft fetch and its loop between steps); the last step before the engine
            # idles ends here
            self._pending = (shape, committed, self._load, self._decided, self._step_start, time.perf_counter())
            if not self.get_num_unfinished_requests():
                self._observe_pending(self._pending[-1])
        self._plan = None
        self._own_seconds += time.perf_counter() - start
        return outputs

    def _observe_pending(self, end: float) -> None:
        """Feed the last step to the controller: its cycle, from the start of its ``schedule`` to
        ``end`` (the next step's start, or the end of its ``update_from_output`` when the engine
        idles after it)."""
        shape, committed, load, decided, step_start, step_end = self._pending
        self._pending = self._pending_end = None
        self.depth.observe_step(shape, end - step_start, committed, load, step=decided)
        if self._step_log is not None:
            self._step_log.append([load, shape.requests, shape.rows, shape.spec_requests, shape.draft_depth,
                                   shape.draft_passes, shape.draft_rows, shape.draft_requests, shape.prefill_rows,
                                   round(end - step_start, 6), committed if committed is not None else -1])
        if end > step_end:  # (a step before the engine idles has no gap to measure)
            gap_ms, last = 1000 * (end - step_end), self._loop_gap_ms
            self._loop_gap_ms = gap_ms if last is None else 0.99 * last + 0.01 * gap_ms
        self._maybe_log()

    def _free_request(self, request, *args, **kwargs):
        self.depth.finish(request.request_id, request.num_output_tokens)
        return super()._free_request(request, *args, **kwargs)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            logger.info("ProVe adaptive depth: %s", self.depth.summary())


class PlainStepRunnerMixin:
    """Mixed into the model runner under the adaptive depth (lossless, sd), so that a plain step costs
    what a plain engine's step does.

    A step that verifies no draft and drafts nothing (``num_spec_tokens_to_schedule == 0``) runs
    vLLM's own non-speculative path: the runner's ``speculative_config`` is hidden for that step's
    ``execute_model`` and ``sample_tokens``, the switch vLLM reads for every speculative piece of
    a step (spec-decode metadata and logits indices, ``gpu_model_runner.py:2184``; the rejection
    sampler; the drafter and its draft copy, l.4378). A speculative engine otherwise pays about
    0.3 ms of a 8.7 ms plain step at 16 in flight on the CPU.
    Not for hybrid (Mamba-style) models: their recurrent state reads a speculative offset even on
    a step without drafts (l.1555, l.2211).

    A step with ``D = 0`` that still verifies drafts (drafted by the step before) keeps vLLM's
    speculative path but skips the drafter's plumbing (next-token and padded-input preparation,
    l.4748) and pass, and an all-greedy step that verifies no draft is sampled by vLLM's plain
    sampler. vLLM's draft model (mode ``sd``) catches its KV up when it next drafts
    (``proposers.CatchUpDraftModelProposer``), told of every step by ``note_step``."""

    _prove_plain_step = False  # this step runs vLLM's non-speculative path

    def execute_model(self, scheduler_output, *args, **kwargs):
        if hasattr(self.drafter, "note_step") and (scheduler_output.total_num_scheduled_tokens
                                                   or scheduler_output.finished_req_ids):
            self.drafter.note_step(scheduler_output)  # (an empty step may report finished requests)
        self._prove_plain_step = (
            not self.model_config.is_hybrid
            and scheduler_output.total_num_scheduled_tokens > 0
            and scheduler_output.num_spec_tokens_to_schedule == 0
            and not any(scheduler_output.scheduled_spec_decode_tokens.values()))
        if not self._prove_plain_step:
            return super().execute_model(scheduler_output, *args, **kwargs)
        with self._speculation_hidden():
            return super().execute_model(scheduler_output, *args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        if not self._prove_plain_step:
            return super().sample_tokens(*args, **kwargs)
        self._prove_plain_step = False
        with self._speculation_hidden():
            return super().sample_tokens(*args, **kwargs)

    @contextlib.contextmanager
    def _speculation_hidden(self):
        spec_config, self.speculative_config = self.speculative_config, None
        try:
            yield
        finally:
            self.speculative_config = spec_config

    def _sample(self, logits, spec_decode_metadata):
        # A speculative engine builds spec-decode metadata for every step (gpu_model_runner.py:2184)
        # and samples through the rejection sampler even when no request has a draft; for an
        # all-greedy step without drafts vLLM's plain sampler gives the same argmax, cheaper.
        # (Steps that sample keep the rejection sampler: seeded generators then advance as always.)
        if (spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0
                and self.input_batch.sampling_metadata.all_greedy):
            spec_decode_metadata = None
        return super()._sample(logits, spec_decode_metadata)

    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        if scheduler_output.num_spec_tokens_to_schedule == 0:
            self._draft_probs = self._draft_prob_req_ids = None
            return torch.zeros((len(self.input_batch.req_ids), 0), dtype=torch.int32, device=self.device)
        return super().propose_draft_token_ids(scheduler_output, *args, **kwargs)


def plain_step_runner_class(runner_cls: type) -> type:
    """``runner_cls`` with ``PlainStepRunnerMixin`` (one class per runner class)."""
    return type(f"ProveAdaptive{runner_cls.__name__}", (PlainStepRunnerMixin, runner_cls), {})
