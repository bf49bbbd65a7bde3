"""Executors of the adaptive depth: a plain step asks the workers for no drafts, and the
controller's summary is answered in the engine-core process.

A synchronous speculative engine fetches the step's drafts from the workers after every step:
``EngineCore.post_step`` -> ``Executor.take_draft_token_ids`` (``vllm/v1/engine/core.py:689``),
one more round trip to the worker processes. A step the adaptive depth runs plain drafts
nothing (``SchedulerOutput.num_spec_tokens_to_schedule == 0``, ``adaptive.AdaptiveScheduler``),
so the answer is known before asking: every request it scheduled already had its drafts
cleared by vLLM's scheduler (``request.spec_token_ids = []``, ``scheduler.py:876``), which is
all ``update_draft_token_ids`` would do with empty drafts. At 32 requests in flight on the
CPU that round trip is about 0.3 ms of an 8.6 ms step (measured on the zoo proposer, fp32).

``settings.install_executor`` swaps these in for vLLM's resolved ``"mp"`` and ``"uni"``
backends of an engine with the adaptive depth (``parallel_config.distributed_executor_backend``
takes an ``Executor`` subclass); Ray and external launchers keep vLLM's executor and its
round trip.

``LLM.collective_rpc("prove_adaptive_summary")`` reaches the executor in the engine-core
process, where the scheduler runs: these executors answer it from the engine's
``AdaptiveScheduler`` (registered by ``serve_summary``) as of the moment of the call, without
asking the workers. An engine on another executor gets it from its workers, which keep the
summary the scheduler attaches to every step's ``SchedulerOutput`` (built, sent and read every
step: ~0.03 ms of the engine core's time and a few hundred bytes per step that ours save).
``LLM.collective_rpc("prove_step_log", args=(on,))`` is answered the same way, from the
scheduler's per-step log (``AdaptiveScheduler.prove_step_log``; these executors only: the
workers have no such log).
"""

from __future__ import annotations

import weakref

from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.executor.uniproc_executor import UniProcExecutor

SUMMARY_RPC = "prove_adaptive_summary"
STEP_LOG_RPC = "prove_step_log"
_schedulers: dict[int, weakref.ref] = {}  # id(the engine's VllmConfig) -> its AdaptiveScheduler


def serve_summary(scheduler) -> bool:
    """Make ``scheduler`` the source of ``SUMMARY_RPC`` for its engine's executor (they share the
    engine's ``VllmConfig`` object); whether that executor is one of these, which answer it
    (else the scheduler must ship its summary to the workers every step)."""
    _schedulers[id(scheduler.vllm_config)] = weakref.ref(scheduler)
    backend = scheduler.vllm_config.parallel_config.distributed_executor_backend
    return isinstance(backend, type) and issubclass(backend, SkipPlainDraftFetch)


class SkipPlainDraftFetch:
    """Executor mixin: no ``take_draft_token_ids`` round trip after a step that drafted nothing;
    ``SUMMARY_RPC`` answered by the engine's scheduler."""

    _prove_step_drafted = True  # until the first step says otherwise

    def collective_rpc(self, method, *args, **kwargs):
        if method in (SUMMARY_RPC, STEP_LOG_RPC) and not kwargs.get("non_block") and len(args) < 4:
            ref = _schedulers.get(id(self.vllm_config))
            scheduler = ref() if ref is not None else None
            if scheduler is not None:  # (one answer per worker, as the workers would give)
                if method == SUMMARY_RPC:
                    answer = scheduler.prove_adaptive_summary()
                else:  # the RPC's own args and kwargs: (timeout, args, kwargs) as EngineCore passes them
                    rpc_args = args[1] if len(args) > 1 else kwargs.get("args")
                    rpc_kwargs = args[2] if len(args) > 2 else kwargs.get("kwargs")
                    answer = scheduler.prove_step_log(*(rpc_args or ()), **(rpc_kwargs or {}))
                return [answer] * self.vllm_config.parallel_config.world_size
        return super().collective_rpc(method, *args, **kwargs)

    def execute_model(self, scheduler_output, non_block: bool = False):
        self._prove_step_drafted = scheduler_output.num_spec_tokens_to_schedule != 0
        return super().execute_model(scheduler_output, non_block)

    def take_draft_token_ids(self):
        if not self._prove_step_drafted:
            return None  # EngineCore.post_step then leaves the scheduler's (empty) drafts as they are
        return super().take_draft_token_ids()


class ProveMultiprocExecutor(SkipPlainDraftFetch, MultiprocExecutor):
    """vLLM's ``MultiprocExecutor`` (``"mp"``) without the draft round trip of plain steps."""


class ProveUniProcExecutor(SkipPlainDraftFetch, UniProcExecutor):
    """vLLM's ``UniProcExecutor`` (``"uni"``) without the draft call of plain steps."""


EXECUTORS = {"mp": ProveMultiprocExecutor, "uni": ProveUniProcExecutor}
