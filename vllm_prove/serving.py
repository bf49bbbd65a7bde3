"""Serving past one process: ProVe engines as Ray Serve LLM replicas behind one OpenAI endpoint.

``llm_config`` turns the settings ``vllm-prove generate --engine vllm`` runs (one
``DecodeConfig``) into a Ray Serve LLM ``LLMConfig`` whose ``engine_kwargs`` are the same vLLM
flags (``engine.generate.engine_kwargs``): every replica is an ordinary vLLM engine that loads
the plug-in through vLLM's entry point and runs the same mode. ``serve_forever`` joins a cluster
(or starts a local one), builds Ray Serve LLM's OpenAI application, deploys it and keeps it up
until SIGINT / SIGTERM. In Python, in this order (building the application needs Ray up)::

    engine = replica_engine(cfg)                # checked here, before Ray
    started = connect(address)                  # before anything else touches Ray
    config = llm_config(engine, replicas=2)     # accelerator: the cluster's GPUs, else CPU
    deploy(build_app(config))
    ...
    shutdown(started)

The plug-in's start-up checks of its own settings run here, in the driver, before anything is
deployed (``engine.settings.prepare_engine_args``, the checks each replica's engine runs before
vLLM builds its config): a bad value fails ``replica_engine`` naming the field instead of
crash-looping replicas. The model folders are read for that, at the paths every replica will
load them from (a shared file system on a multi-node cluster).

CPU nodes: a replica reserves ``cpus_per_worker`` logical CPUs per tensor-parallel worker, all on
one node (``STRICT_PACK``: its engine runs vLLM's ``mp`` executor, Ray Serve LLM's choice on
CPU), and nothing for its own actor. GPU nodes: one GPU per worker; Ray Serve LLM runs the engine
on Ray's executor there, whose workers answer the adaptive depth's summary
(``engine/executor.py``). Autoscaling adds a replica when the requests per replica exceed its
``max_num_seqs``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any, Literal

from vllm_prove.config import DecodeConfig
from vllm_prove.engine.generate import DEFAULT_CPU_KVCACHE_GIB, engine_kwargs, method_flags
from vllm_prove.errors import ProveError

APP_NAME = "prove"
Accelerator = Literal["cpu", "gpu"]
# environment of the driver that every replica's engine reads as well (vLLM's CPU knobs, offline hubs)
FORWARDED_ENV_PREFIXES = ("VLLM_CPU_", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def check_engine_settings(kwargs: dict[str, Any]) -> None:
    """The plug-in's start-up checks on ``kwargs``, in this process. Keys that are not vLLM
    engine flags (Ray Serve LLM also passes the OpenAI front end's, e.g. ``chat_template``) are
    left to the replicas."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from vllm_prove.engine.settings import prepare_engine_args

    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    prepare_engine_args(AsyncEngineArgs(**{k: v for k, v in kwargs.items() if k in fields}))


def cluster_accelerator() -> Accelerator:
    """``gpu`` where the connected cluster has GPUs, else ``cpu``."""
    import ray

    return "gpu" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


def replica_engine(cfg: DecodeConfig, *, max_num_seqs: int | None = None, tensor_parallel_size: int = 1,
                   engine_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each replica's vLLM engine flags: ``engine_kwargs(cfg)`` with ``max_num_seqs`` requests in
    flight (default ``cfg.batch_size``) and ``engine_overrides`` (any other vLLM flag) on top,
    checked here by the plug-in's start-up checks (no Ray needed)."""
    kwargs = engine_kwargs(cfg, method_flags(cfg), max_num_seqs) | {"tensor_parallel_size": tensor_parallel_size}
    kwargs |= engine_overrides or {}
    try:
        check_engine_settings(kwargs)
    except ProveError:
        raise
    except (TypeError, ValueError) as err:  # vLLM's own check of a flag's value or type
        raise ProveError(f"engine_kwargs: {err}") from err
    return kwargs


def llm_config(engine: dict[str, Any], *, model_id: str | None = None, replicas: int = 1,
               min_replicas: int | None = None, max_replicas: int | None = None,
               accelerator: Accelerator | None = None, cpus_per_worker: float = 1.0):
    """Ray Serve LLM's ``LLMConfig`` serving ``engine`` (``replica_engine``'s flags): ``replicas``
    fixed, or autoscaled between ``min_replicas`` and ``max_replicas`` (0 scales to zero when
    idle). ``accelerator`` defaults to ``cluster_accelerator()`` (connect first)."""
    from ray.serve.llm import LLMConfig

    accelerator = accelerator or cluster_accelerator()
    kwargs = dict(engine)
    model = kwargs.pop("model")
    if min_replicas is None and max_replicas is None:
        deployment: dict[str, Any] = {"num_replicas": replicas}
    else:
        low = 1 if min_replicas is None else min_replicas
        high = max(replicas, low) if max_replicas is None else max_replicas
        if not (0 <= low <= high and high >= 1):
            raise ProveError(f"replicas: autoscaling needs 0 <= min_replicas <= max_replicas >= 1, got {low}..{high}")
        deployment = {"autoscaling_config": {"min_replicas": low, "max_replicas": high,
                                             "initial_replicas": min(max(replicas, low), high),
                                             "target_ongoing_requests": kwargs["max_num_seqs"]}}
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    placement: dict[str, Any] = {"bundle_per_worker": {"CPU": cpus_per_worker}}
    if accelerator == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KVCACHE_GIB)
        accelerator_config: dict[str, Any] = {"kind": "cpu"}
        placement["strategy"] = "STRICT_PACK"  # the mp executor's workers run on the replica's node
        deployment["ray_actor_options"] = {"num_cpus": 0}  # the engine process does the work
    else:
        accelerator_config = {"kind": "gpu"}
        placement["bundle_per_worker"]["GPU"] = 1
    return LLMConfig(model_loading_config={"model_id": model_id or Path(model).name, "model_source": model},
                     engine_kwargs=kwargs, accelerator_config=accelerator_config,
                     placement_group_config=placement, deployment_config=deployment,
                     runtime_env={"env_vars": env}, log_engine_metrics=True)


def connect(address: str | None = None) -> bool:
    """Join the Ray cluster at ``address``, else start a local one of this process's own (never
    one that ``ray start`` left running here); whether this call started Ray (``shutdown`` then
    stops it). Call it before ``build_app``, which would otherwise start Ray by itself."""
    import ray

    if ray.is_initialized():
        raise ProveError("Ray is already initialized in this process: call connect() first")
    try:
        ray.init(address=address or "local", include_dashboard=False, log_to_driver=False)
    except ConnectionError as err:
        raise ProveError(
            f"address: cannot join the Ray cluster at {address!r} ({err}). Ray uses an explicit address without "
            "token authentication unless RAY_AUTH_MODE=token is set (with the cluster's token in ~/.ray/auth_token "
            "or RAY_AUTH_TOKEN); `ray start` enables it where a token exists. --address auto joins the cluster "
            "`ray start` began on this machine with its own settings") from err
    return address is None


def build_app(config):
    """Ray Serve LLM's OpenAI-compatible application serving one ``LLMConfig`` (Ray must be up)."""
    from ray.serve.llm import build_openai_app

    # the OpenAI front end only routes: no CPU of its own, so it schedules beside CPU replicas
    return build_openai_app({"llm_configs": [config], "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}}})


def deploy(app, *, host: str = "127.0.0.1", port: int = 8000, name: str = APP_NAME) -> None:
    """Deploy ``app`` on the connected cluster and wait until every replica is up (a replica that
    fails to start fails this call). One application per cluster: a second deploy replaces it."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=name, route_prefix="/", blocking=False)


def shutdown(started_ray: bool, name: str = APP_NAME) -> None:
    """Remove the application; where this process started Ray, stop Serve and Ray too."""
    import ray
    from ray import serve

    if started_ray:
        serve.shutdown()
        ray.shutdown()
    else:
        serve.delete(name)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def serve_forever(make_config, *, address: str | None = None, host: str = "127.0.0.1", port: int = 8000,
                  name: str = APP_NAME) -> None:
    """Connect, ``make_config()`` (an ``LLMConfig``), deploy, and serve until SIGINT / SIGTERM,
    which also stop a deployment still waiting for its replicas; the application is removed
    either way."""
    started, previous = None, None
    try:
        started = connect(address)
        # after ray.init, whose own SIGTERM handler only logs and re-raises (the process would die
        # with the application still deployed)
        previous = signal.signal(signal.SIGTERM, _interrupt)
        deploy(build_app(make_config()), host=host, port=port, name=name)
        print(f"serving the OpenAI API at http://{host}:{port}/v1 (Ctrl-C stops)", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if started is not None:
            shutdown(started, name)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
