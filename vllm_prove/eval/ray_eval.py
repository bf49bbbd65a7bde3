"""Generation for `vllm-prove eval`: Ray Data's vLLM batch API, or the same batches in-process.

Ray (``--ray``): one ``ray.data.llm`` processor per method (``vLLMEngineProcessorConfig`` +
``build_processor``), ``replicas`` engine actors, each a vLLM engine built from the method's
``engine_kwargs`` (the resolver of ``generate --engine vllm``: ``additional_config={"prove":
...}`` reaches the plug-in). On a node without GPUs the engine stage asks for CPU bundles; two
actors need ``concurrency=(R, R)``, ``max_tasks_in_flight_per_actor=1`` (else the first actor
takes every batch) and the pool waits for all its actors before the first batch. Against a
cluster address the code is the same; GPUs are asked for when the cluster has them.

What a measurement needs from each engine (methods.md §8), added to Ray's engine stage by a
subclass of its UDF (``ray.llm._internal``: Ray 2.60 exactly, pinned in pyproject.toml):

- a fixed-prompt speed probe before the engine's first batch, with as many copies in flight as
  the engine will hold (the first steps at a new batch size pay one-off costs);
- the engine's own spec-decode counters over each batch (vLLM's Prometheus counters in the
  actor's process: committed tokens per cycle, per-position acceptance);
- each request's in-flight interval from the engine's own timestamps (``scheduled_ts`` to
  ``last_token_ts`` of ``RequestOutput.metrics``), never Ray's wall clock. One batch at a
  time per actor, so batches of one engine never overlap.

In-process (no ``--ray``): the same batches, records and counters on one ``vllm.LLM``.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Callable, Iterable

from vllm_prove.config import DecodeConfig
from vllm_prove.engine import generate as engine_gen
from vllm_prove.eval.engine_bench import PROBE

SETTLE_POLLS = 200  # x 10 ms: the engine's last step is logged right after its outputs
WAIT_FOR_ACTORS_S = 1800  # engine start-up on a busy CPU node takes minutes


def engine_settings(cfg: DecodeConfig, concurrency: int) -> dict:
    """``LLM(...)`` kwargs of a method at ``concurrency`` requests in flight per engine."""
    return engine_gen.engine_kwargs(cfg, engine_gen.method_flags(cfg), max_num_seqs=concurrency)


def make_record(row: dict, *, token_ids, text: str, prompt_token_ids, start: float, end: float, engine: str,
                batch: str, batch_rows: int, spec: dict) -> dict:
    """One generated row as stored in a shard (both paths write exactly this)."""
    return {"task": row["task"], "index": row["index"], "token_ids": [int(t) for t in token_ids], "text": text,
            "prompt_token_ids": [int(t) for t in prompt_token_ids or []], "start": float(start), "end": float(end),
            "engine": engine, "batch": batch, "batch_rows": int(batch_rows), "spec": spec}


def _spec_snapshot():
    """Cumulative spec-decode counters of the vLLM engine(s) of this process."""
    from vllm_prove.engine import metrics

    return metrics.process_snapshot()


# -- Ray ---------------------------------------------------------------------------------------

def _counted_udf_class():
    from ray.llm._internal.batch.stages.vllm_engine_stage import vLLMEngineStageUDF

    class CountedEngineUDF(vLLMEngineStageUDF):
        """Ray's vLLM engine stage, plus the speed probe, per-batch counters and engine id."""

        async def udf(self, batch):
            import ray
            from vllm import SamplingParams

            if not getattr(self, "_probed", False):  # the probe fills the engine, as the batches will
                params = SamplingParams(temperature=0.0, max_tokens=PROBE[1])
                copies = self.llm.get_scheduler_config().max_num_seqs
                await asyncio.gather(*(_drain(self.llm.engine.generate(PROBE[0], params, f"probe-{uuid.uuid4().hex}"))
                                       for _ in range(copies)))
                self._probed = True
            before = _spec_snapshot()
            rows = [row async for row in super().udf(batch)]
            after = await _settled(before)
            spec = json.dumps((after - before).to_json())
            engine = ray.get_runtime_context().get_actor_id()
            for row in rows:
                yield {**row, "engine_id": engine, "batch_rows": len(rows), "batch_spec": spec}

    return CountedEngineUDF


async def _drain(outputs) -> None:
    async for _ in outputs:
        pass


async def _settled(before):
    """The counters once the engine's last step of the batch is logged (they stop changing)."""
    last, stable = _spec_snapshot(), 0
    for _ in range(SETTLE_POLLS):
        await asyncio.sleep(0.01)
        now = _spec_snapshot()
        stable = stable + 1 if now == last else 0
        if stable >= 3 and (now != before or stable >= 10):
            return now
        last = now
    return last


def _preprocess(row: dict) -> dict:
    return {"prompt": row["prompt"], "sampling_params": json.loads(row["sampling"])}


def _postprocess(row: dict) -> dict:
    stats = row.get("metrics") or {}
    return make_record(row, token_ids=row["generated_tokens"], text=row["generated_text"],
                       prompt_token_ids=row.get("prompt_token_ids"), start=stats.get("scheduled_ts", 0.0),
                       end=stats.get("last_token_ts", 0.0), engine=row["engine_id"], batch=row["batch_uuid"],
                       batch_rows=row["batch_rows"], spec=row["batch_spec"])  # spec: JSON text through Arrow


def connect(address: str | None, replicas: int) -> None:
    """Join ``address`` (a running cluster), or start a local one with enough logical CPUs for
    the engine actors and the small pre/post-processing stages."""
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        # "local": a new cluster of our own, never one that `ray start` left on this machine
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, replicas + 4), include_dashboard=False,
                 log_to_driver=False)


def _cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def build_processor(cfg: DecodeConfig, *, replicas: int, concurrency: int, batch_size: int, gpu: bool):
    """The method's ``ray.data.llm`` processor: ``replicas`` engine actors on CPU bundles, or on
    GPUs (Ray's default bundles) when ``gpu``."""
    from ray.data.llm import build_processor as ray_build_processor
    from ray.data.llm import vLLMEngineProcessorConfig

    kwargs = engine_settings(cfg, concurrency)
    model = kwargs.pop("model")
    workers = kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1)
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if not gpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", engine_gen.DEFAULT_CPU_KVCACHE_GIB)
    config = vLLMEngineProcessorConfig(
        model_source=model, engine_kwargs=kwargs, batch_size=batch_size, concurrency=(replicas, replicas),
        max_tasks_in_flight_per_actor=1, placement_group_config=None if gpu else {"bundles": [{"CPU": 1}] * workers},
        chat_template_stage=False, tokenize_stage=False, detokenize_stage=False, log_engine_metrics=False,
        runtime_env={"env_vars": env})
    processor = ray_build_processor(config, preprocess=_preprocess, postprocess=_postprocess)
    # validate_assignment would re-run the stage's validator, which has already consumed the
    # placement group (it would fall back to GPU bundles): set the UDF class as plain data.
    object.__setattr__(processor.get_stage_by_name("vLLMEngineStage"), "fn", _counted_udf_class())
    return processor


def generate_ray(cfg: DecodeConfig, rows: list[dict], *, replicas: int, concurrency: int, batch_size: int,
                 on_record: Callable[[dict], None]) -> None:
    """Decode ``rows`` (dicts with task, index, prompt, sampling) on ``replicas`` Ray engine actors."""
    import ray

    processor = build_processor(cfg, replicas=replicas, concurrency=concurrency, batch_size=batch_size,
                                gpu=_cluster_has_gpus())
    context = ray.data.DataContext.get_current()
    context.wait_for_min_actors_s = WAIT_FOR_ACTORS_S  # every replica is up before the first batch
    context.enable_progress_bars = False
    for row in processor(ray.data.from_items(rows)).iter_rows():
        on_record({**row, "spec": json.loads(row["spec"])})


# -- in-process --------------------------------------------------------------------------------

def generate_local(cfg: DecodeConfig, rows: list[dict], *, concurrency: int, batch_size: int,
                   on_record: Callable[[dict], None]) -> None:
    """The same batches on one in-process engine (``concurrency`` requests in flight)."""
    with engine_gen.engine(engine_settings(cfg, concurrency)) as llm:
        from vllm import SamplingParams

        from vllm_prove.engine import metrics

        engine_gen.drive(llm, [PROBE[0]] * concurrency, SamplingParams(temperature=0.0, max_tokens=PROBE[1]),
                         concurrency)  # the probe fills the engine, as the batches will
        engine = f"local-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        for batch in _chunks(rows, batch_size):
            before = metrics.from_engine_metrics(llm.get_metrics())
            outputs = llm.generate([r["prompt"] for r in batch],
                                   [SamplingParams(**json.loads(r["sampling"])) for r in batch], use_tqdm=False)
            spec = (metrics.from_engine_metrics(llm.get_metrics()) - before).to_json()
            batch_id = uuid.uuid4().hex
            for row, out in zip(batch, outputs):
                on_record(make_record(row, token_ids=out.outputs[0].token_ids, text=out.outputs[0].text,
                                      prompt_token_ids=out.prompt_token_ids, start=out.metrics.scheduled_ts,
                                      end=out.metrics.last_token_ts, engine=engine, batch=batch_id,
                                      batch_rows=len(batch), spec=spec))


def _chunks(rows: list[dict], size: int) -> Iterable[list[dict]]:
    for start in range(0, len(rows), size):
        yield rows[start: start + size]
