"""Who answers ``LLM.collective_rpc("prove_adaptive_summary")`` (vllm_prove/engine/executor.py), without
an engine: the plug-in's executors ask the engine's ``AdaptiveScheduler`` in the engine-core
process, as of the call; everything else, and an engine on another executor (Ray), goes to the
workers (whose summary the scheduler then ships every step). The engine test
(test_engine_lossless.py) reads the summary through a real engine and checks it against vLLM's
own spec-decode counters."""

from __future__ import annotations

import gc
from types import SimpleNamespace

from vllm_prove.engine.executor import EXECUTORS, SUMMARY_RPC, SkipPlainDraftFetch, serve_summary


class _Workers:
    """The executor's base: what its workers would answer."""

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False):
        return [f"worker:{method}:non_block={non_block}"]


class _Executor(SkipPlainDraftFetch, _Workers):
    def __init__(self, vllm_config) -> None:
        self.vllm_config = vllm_config


class _Scheduler:
    def __init__(self, vllm_config) -> None:
        self.vllm_config, self.asked = vllm_config, 0

    def prove_adaptive_summary(self) -> dict:
        self.asked += 1
        return {"steps": 7 + self.asked}


def _config(backend, world_size: int = 1):
    return SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend,
                                                           world_size=world_size))


def test_the_plugins_executor_answers_the_summary_from_the_scheduler_as_of_the_call():
    config = _config(EXECUTORS["mp"], world_size=2)
    scheduler = _Scheduler(config)
    assert serve_summary(scheduler)  # (the scheduler need not ship it every step)
    executor = _Executor(config)
    assert executor.collective_rpc(SUMMARY_RPC) == [{"steps": 8}] * 2  # one answer per worker
    assert executor.collective_rpc(SUMMARY_RPC, None, (), None) == [{"steps": 9}] * 2  # (EngineCore's call)
    assert scheduler.asked == 2
    # any other RPC, and a non-blocking one (which wants a future), goes to the workers
    assert executor.collective_rpc("execute_model") == ["worker:execute_model:non_block=False"]
    assert executor.collective_rpc(SUMMARY_RPC, non_block=True) == [f"worker:{SUMMARY_RPC}:non_block=True"]
    # another engine's executor (another VllmConfig) is not answered from this scheduler
    assert _Executor(_config(EXECUTORS["mp"])).collective_rpc(SUMMARY_RPC) == [f"worker:{SUMMARY_RPC}:non_block=False"]
    # nor once the scheduler is gone (the registry holds it weakly)
    del scheduler
    gc.collect()
    assert executor.collective_rpc(SUMMARY_RPC) == [f"worker:{SUMMARY_RPC}:non_block=False"]


def test_a_scheduler_on_another_executor_ships_its_summary():
    for backend in ("ray", "external_launcher", object):
        assert not serve_summary(_Scheduler(_config(backend)))
    assert serve_summary(_Scheduler(_config(EXECUTORS["uni"])))
