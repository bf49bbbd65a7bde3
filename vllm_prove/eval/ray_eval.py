"""Generation for `vllm-prove eval`: the same batches on Ray engine actors or in-process.

One class, ``EngineActor``, owns a vLLM engine built from the method's ``engine_kwargs`` (the
resolver of ``generate --engine vllm``: ``additional_config={"prove": ...}`` reaches the
plug-in) and turns a batch of rows into records. In-process (no ``--ray``) one instance serves
every batch. With ``--ray`` Ray Data runs ``replicas`` of it as an actor pool
(``Dataset.map_batches`` with ``ActorPoolStrategy``: public Ray Data API only): each actor one
engine on CPU bundles, or on GPUs when the cluster has them; one batch at a time per actor
(``max_tasks_in_flight_per_actor=1``, else the first actor takes every batch) and the pool waits
for all its actors before the first batch. Against a cluster address the code is the same.

``ray.data.llm``'s vLLM stage is not used: its engine runs in Ray's own actor class, and what a
measurement needs from each engine (docs/METHODS.md §8) has no public hook there:

- a fixed-prompt speed probe before the engine's first batch, with as many copies in flight as
  the engine will hold (the first steps at a new batch size pay one-off costs);
- the engine's own spec-decode counters over each batch (vLLM's metrics in the actor's
  process: committed tokens per cycle, per-position acceptance);
- each request's in-flight interval from the engine's own timestamps (``scheduled_ts`` to
  ``last_token_ts`` of ``RequestOutput.metrics``), never Ray's wall clock. One batch at a
  time per engine, so batches of one engine never overlap.

Given up with it: Ray's chat-template and tokenizer stages (rows here carry finished prompts)
and its streaming of rows through an async engine (a batch here is one ``LLM.generate``).
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Callable, Iterable

from vllm_prove.config import DecodeConfig
from vllm_prove.engine import generate as engine_gen
from vllm_prove.eval.engine_bench import PROBE

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


class EngineActor:
    """One vLLM engine (``engine_kwargs``) that probes its speed once, then turns batches of rows
    (task, index, prompt, sampling as JSON) into records with the batch's spec-decode counters.
    Called by Ray Data with a batch of columns (a Ray actor), or ``generate`` directly."""

    def __init__(self, engine_kwargs: dict, engine_id: str | None = None) -> None:
        self._stack = contextlib.ExitStack()
        self.llm = self._stack.enter_context(engine_gen.engine(engine_kwargs))
        from vllm import SamplingParams

        if engine_id is None:
            import ray

            engine_id = ray.get_runtime_context().get_actor_id()
        self.engine = engine_id
        in_flight = engine_kwargs["max_num_seqs"]  # the probe fills the engine, as the batches will
        engine_gen.drive(self.llm, [PROBE[0]] * in_flight, SamplingParams(temperature=0.0, max_tokens=PROBE[1]),
                         in_flight)

    def generate(self, rows: list[dict]) -> list[dict]:
        from vllm import SamplingParams

        from vllm_prove.engine import metrics

        before = metrics.from_engine_metrics(self.llm.get_metrics())
        outputs = self.llm.generate([r["prompt"] for r in rows],
                                    [SamplingParams(**json.loads(r["sampling"])) for r in rows], use_tqdm=False)
        spec = (metrics.from_engine_metrics(self.llm.get_metrics()) - before).to_json()
        batch = uuid.uuid4().hex
        return [make_record(row, token_ids=out.outputs[0].token_ids, text=out.outputs[0].text,
                            prompt_token_ids=out.prompt_token_ids, start=out.metrics.scheduled_ts,
                            end=out.metrics.last_token_ts, engine=self.engine, batch=batch, batch_rows=len(rows),
                            spec=spec) for row, out in zip(rows, outputs)]

    def __call__(self, columns: dict) -> dict:
        rows = [{key: value.item() if hasattr(value, "item") else value for key, value in zip(columns, values)}
                for values in zip(*columns.values())]  # (numpy scalars -> Python values)
        records = [{**r, "spec": json.dumps(r["spec"])} for r in self.generate(rows)]  # (JSON text through Arrow)
        return {key: [r[key] for r in records] for key in records[0]}

    def close(self) -> None:
        self._stack.close()


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


def actor_pool_args(cfg: DecodeConfig, *, replicas: int, concurrency: int, batch_size: int, gpu: bool) -> dict:
    """``Dataset.map_batches`` arguments of a method's engine actors: ``replicas`` of them, each
    on the CPUs of its engine's workers, or on one GPU per worker when ``gpu``."""
    from ray.data import ActorPoolStrategy

    kwargs = engine_settings(cfg, concurrency)
    workers = kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1)
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if not gpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", engine_gen.DEFAULT_CPU_KVCACHE_GIB)
    resources = {"num_gpus": workers} if gpu else {"num_cpus": workers}
    return {"fn": EngineActor, "fn_constructor_kwargs": {"engine_kwargs": kwargs}, "batch_size": batch_size,
            "compute": ActorPoolStrategy(min_size=replicas, max_size=replicas, max_tasks_in_flight_per_actor=1),
            "runtime_env": {"env_vars": env}, **resources}


def generate_ray(cfg: DecodeConfig, rows: list[dict], *, replicas: int, concurrency: int, batch_size: int,
                 on_record: Callable[[dict], None]) -> None:
    """Decode ``rows`` (dicts with task, index, prompt, sampling) on ``replicas`` Ray engine actors."""
    import ray

    args = actor_pool_args(cfg, replicas=replicas, concurrency=concurrency, batch_size=batch_size,
                           gpu=_cluster_has_gpus())
    context = ray.data.DataContext.get_current()
    context.wait_for_min_actors_s = WAIT_FOR_ACTORS_S  # every replica is up before the first batch
    context.enable_progress_bars = False
    for row in ray.data.from_items(rows).map_batches(**args).iter_rows():
        on_record({**row, "spec": json.loads(row["spec"])})


# -- in-process --------------------------------------------------------------------------------

def generate_local(cfg: DecodeConfig, rows: list[dict], *, concurrency: int, batch_size: int,
                   on_record: Callable[[dict], None]) -> None:
    """The same batches on one in-process engine (``concurrency`` requests in flight)."""
    actor = EngineActor(engine_settings(cfg, concurrency), engine_id=f"local-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        for batch in _chunks(rows, batch_size):
            for record in actor.generate(batch):
                on_record(record)
    finally:
        actor.close()


def _chunks(rows: list[dict], size: int) -> Iterable[list[dict]]:
    for start in range(0, len(rows), size):
        yield rows[start: start + size]
