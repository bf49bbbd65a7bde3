"""Workers that install ProVe into the model runner vLLM just built.

``init_device`` builds the stock runner (``vllm/v1/worker/cpu_worker.py:168-177``,
``gpu_worker.py:558``) and with it vLLM's drafter; ``load_model`` comes later and calls
``drafter.load_model(runner.model)`` (``cpu_model_runner.py:74-76``), so replacing the
drafter right after ``init_device`` is enough for it to share the loaded target. The
plugin names these classes in ``parallel_config.worker_cls``; by hand:
``--worker-cls vllm_prove.engine.worker.ProveCPUWorker`` (``ProveGPUWorker`` on CUDA).
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from vllm_prove.config import EngineMode
from vllm_prove.engine import cpu_fixes
from vllm_prove.engine.gate_runner import ProveGateRunnerMixin, gate_runner_class
from vllm_prove.engine.proposers import CatchUpDraftModelProposer, SelfMaskProposer, SharedTargetProposer
from vllm_prove.engine.settings import engine_settings

logger = init_logger(__name__)


def install(worker) -> None:
    """Put the mode's drafter (and, in the gated modes, the gate) into ``worker.model_runner``."""
    settings = engine_settings(worker.vllm_config)
    runner = worker.model_runner
    if settings is None:
        return
    if not isinstance(runner, GPUModelRunner) or not hasattr(runner, "drafter"):
        raise RuntimeError(
            f"ProVe needs vLLM's Model Runner V1 with a drafter, got {type(runner).__name__}; "
            "ProVe engines run Model Runner V1 (plugin.register selects it in their config)"
        )
    if settings.mode is EngineMode.LOSSLESS:
        runner.drafter = SelfMaskProposer(worker.vllm_config, runner.device, runner)
    if settings.mode is EngineMode.SDD:
        from vllm_prove.engine.diffusion import DiffusionProposer, sdd_runner_class

        runner.drafter = DiffusionProposer(worker.vllm_config, runner.device, runner, settings)
        runner.__class__ = sdd_runner_class(type(runner))
        runner.prove = settings
    if not settings.mode.gated:  # vLLM's rejection sampler verifies: unverified draft probabilities wait
        from vllm_prove.engine.seeded import keep_draft_probs_runner_class

        runner.__class__ = keep_draft_probs_runner_class(type(runner))
    if settings.adaptive_on:  # lossless, sd: plain steps as cheap as a plain engine's
        from vllm_prove.engine.adaptive import plain_step_runner_class

        runner.__class__ = plain_step_runner_class(type(runner))
        if settings.mode is EngineMode.SD:  # plain steps skip the draft model; it catches up
            runner.drafter = CatchUpDraftModelProposer(worker.vllm_config, runner.device, runner)
    if settings.mode.gated:
        if settings.mode is EngineMode.MARS:
            runner.drafter = SharedTargetProposer(worker.vllm_config, runner.device, runner)
        # verifier mode keeps vLLM's DraftModelProposer: it loads the verifier and its KV.
        runner.__class__ = gate_runner_class(type(runner))
        runner.prove = settings
    logger.info("ProVe %s mode installed: runner %s, drafter %s", settings.mode.value,
                type(runner).__name__, type(runner.drafter).__name__)


class _ProveWorkerMixin:
    """``init_device`` post-hook, plus RPCs for tests (``LLM.collective_rpc("prove_...")``)."""

    def init_device(self) -> None:
        super().init_device()
        install(self)
        self._prove_draft_fetches = {"steps": 0, "drafting_steps": 0, "fetches": 0, "plain_path_steps": 0}

    def execute_model(self, scheduler_output, *args, **kwargs):
        from vllm_prove.engine.adaptive import SUMMARY_ATTR

        summary = getattr(scheduler_output, SUMMARY_ATTR, None)
        if summary is not None:
            self._prove_adaptive_summary = summary
        if scheduler_output.total_num_scheduled_tokens:
            self._prove_draft_fetches["steps"] += 1
            self._prove_draft_fetches["drafting_steps"] += scheduler_output.num_spec_tokens_to_schedule != 0
        output = super().execute_model(scheduler_output, *args, **kwargs)
        self._prove_draft_fetches["plain_path_steps"] += getattr(self.model_runner, "_prove_plain_step", False)
        return output

    def take_draft_token_ids(self):
        self._prove_draft_fetches["fetches"] += 1
        drafts = super().take_draft_token_ids()
        records = getattr(self, "_prove_draft_records", None)
        if records is not None and drafts is not None:
            self._record_drafts(drafts, records)
        return drafts

    def _record_drafts(self, drafts, records: list) -> None:
        runner = self.model_runner
        batch = runner.input_batch
        caught_up = getattr(runner.drafter, "last_caught_up", frozenset())
        reused = getattr(runner.drafter, "last_reused", frozenset())
        for req_id, tokens in zip(drafts.req_ids, drafts.draft_token_ids):
            index = batch.req_id_to_index.get(req_id)
            if index is None or runner.discard_request_mask.np[index] or not len(tokens):
                continue  # a prompt still being prefilled: its drafts are discarded
            context = batch.token_ids_cpu[index, : batch.num_tokens_no_spec[index]].tolist()
            records.append((context, [int(t) for t in tokens], req_id in caught_up, req_id in reused))

    def prove_record_drafts(self, on: bool = True) -> list | None:
        """Record each drafting step's drafts with the committed context they follow (a test of
        the draft KV under the adaptive depth); returns what was recorded so far and, with
        ``on`` False, stops. Records: (context token ids, drafts, whether catch-up ran first,
        whether the request was just admitted on prefix-cached draft KV, reused without catch-up)."""
        records = getattr(self, "_prove_draft_records", None)
        self._prove_draft_records = [] if on else None
        return records

    def prove_draft_fetches(self) -> dict[str, int]:
        """Steps the worker ran, those that drafted (``num_spec_tokens_to_schedule != 0``), the
        engine's draft fetches (``take_draft_token_ids``: under the adaptive depth a plain step
        fetches nothing, ``executor``), and the steps that ran vLLM's non-speculative path
        (``adaptive.PlainStepRunnerMixin``)."""
        return dict(self._prove_draft_fetches)

    def prove_probe(self) -> dict[str, Any]:
        """What the engine is running: runner, drafter, weight/KV sharing, KV blocks."""
        runner = self.model_runner
        drafter = getattr(runner, "drafter", None)
        kv_config = runner.kv_cache_config
        return {
            "runner": type(runner).__name__,
            "gated": isinstance(runner, ProveGateRunnerMixin),
            "drafter": type(drafter).__name__ if drafter is not None else None,
            "drafter_shares_model": drafter is not None and getattr(drafter, "model", None) is runner.model,
            "kv_layers": sorted(name for group in kv_config.kv_cache_groups for name in group.layer_names),
            "num_blocks": kv_config.num_blocks,
        }

    def prove_adaptive_summary(self) -> dict | None:
        """The adaptive depth's decisions and cost estimates as of the last step (None before any,
        or without the adaptive depth): ``DepthController.summary()``, sent by the scheduler."""
        return getattr(self, "_prove_adaptive_summary", None)

    def prove_sdd_counters(self, reset: bool = False) -> dict | None:
        """Mode ``sdd``: draft blocks, verifier calls, skipped rounds and tokens, and StrictToken /
        FullPrefix of the relaxed rules since start-up (or the last reset); None in other modes."""
        from vllm_prove.engine.diffusion import DiffusionProposer, SDDCounters

        drafter = getattr(self.model_runner, "drafter", None)
        if not isinstance(drafter, DiffusionProposer):
            return None
        summary = drafter.counters.summary()
        if reset:
            drafter.counters = SDDCounters()
        return summary

    def prove_set_cpu_sampling_fix(self, enabled: bool) -> bool:
        """Switch the CPU expand-kernel fix (test of ``cpu_fixes``); True if it applies here."""
        if enabled:
            return cpu_fixes.apply()
        cpu_fixes.restore_vllm_kernel()
        return True


class ProveCPUWorker(_ProveWorkerMixin, CPUWorker):
    """vLLM's CPU worker with ProVe installed."""


class ProveGPUWorker(_ProveWorkerMixin, Worker):
    """vLLM's GPU worker with ProVe installed."""
