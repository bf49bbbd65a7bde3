"""Executors of the adaptive depth: a plain step asks the workers for no drafts.

A synchronous speculative engine fetches the step's drafts from the workers after every step:
``EngineCore.post_step`` -> ``Executor.take_draft_token_ids`` (``vllm/v1/engine/core.py:689``),
one more round trip to the worker processes. A step the adaptive depth runs plain drafts
nothing (``SchedulerOutput.num_spec_tokens_to_schedule == 0``, ``adaptive.AdaptiveScheduler``),
so the answer is known before asking: every request it scheduled already had its drafts
cleared by vLLM's scheduler (``request.spec_token_ids = []``, ``scheduler.py:876``), which is
all ``update_draft_token_ids`` would do with empty drafts. At 32 requests in flight on the
CPU that round trip is about 0.3 ms of an 8.6 ms step (docs/BENCHMARKS.md, session 9).

``settings.install_executor`` swaps these in for vLLM's resolved ``"mp"`` and ``"uni"``
backends of an engine with the adaptive depth (``parallel_config.distributed_executor_backend``
takes an ``Executor`` subclass); Ray and external launchers keep vLLM's executor and its
round trip.
"""

from __future__ import annotations

from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.executor.uniproc_executor import UniProcExecutor


class SkipPlainDraftFetch:
    """Executor mixin: no ``take_draft_token_ids`` round trip after a step that drafted nothing."""

    _prove_step_drafted = True  # until the first step says otherwise

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
