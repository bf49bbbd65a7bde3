"""Serving past one process: ProVe engines as Ray Serve LLM replicas behind one OpenAI endpoint.

``llm_config`` turns the settings ``vllm-prove generate --engine vllm`` runs (one
``DecodeConfig``) into a Ray Serve LLM ``LLMConfig`` whose ``engine_kwargs`` are the same vLLM
flags (``engine.generate.engine_kwargs``): every replica is an ordinary vLLM engine that loads
the plug-in through vLLM's entry point and runs the same mode. ``build_app`` wraps it in Ray
Serve LLM's OpenAI application; ``deploy`` runs that on a cluster (a local one it starts, or
``address``) and ``serve_forever`` keeps it up until interrupted.

The engine's settings are checked here, in the driver, exactly as each replica's engine will
check them at start-up (``engine.settings.prepare_engine_args``): a bad value fails
``llm_config`` naming the field, before anything is deployed, instead of crash-looping replicas.

CPU nodes: a replica reserves ``cpus_per_worker`` logical CPUs per tensor-parallel worker and
nothing for its own actor (the engine does the work); its engine runs vLLM's ``mp`` executor
(Ray Serve LLM's choice on CPU). GPU nodes: one GPU per worker, Ray's executor.
"""

from __future__ import annotations

import os
import signal
import threading
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
    """The plug-in's start-up checks on ``kwargs`` (vLLM ``EngineArgs`` fields), in this process."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from vllm_prove.engine.settings import prepare_engine_args

    prepare_engine_args(AsyncEngineArgs(**kwargs))


def default_accelerator() -> Accelerator:
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def llm_config(cfg: DecodeConfig, *, model_id: str | None = None, replicas: int = 1,
               min_replicas: int | None = None, max_replicas: int | None = None,
               max_num_seqs: int | None = None, tensor_parallel_size: int = 1,
               accelerator: Accelerator | None = None, cpus_per_worker: float = 1.0,
               engine_overrides: dict[str, Any] | None = None):
    """Ray Serve LLM's ``LLMConfig`` for ``cfg``'s method: ``replicas`` fixed, or autoscaled
    between ``min_replicas`` and ``max_replicas``; each replica's engine is ``engine_kwargs(cfg)``
    with ``max_num_seqs`` requests in flight (default ``cfg.batch_size``) and
    ``engine_overrides`` (any other vLLM engine flag) on top."""
    from ray.serve.llm import LLMConfig

    accelerator = accelerator or default_accelerator()
    kwargs = engine_kwargs(cfg, method_flags(cfg), max_num_seqs) | {"tensor_parallel_size": tensor_parallel_size}
    kwargs |= engine_overrides or {}
    model = kwargs.pop("model")
    check_engine_settings({"model": model, **kwargs})
    if min_replicas is None and max_replicas is None:
        deployment: dict[str, Any] = {"num_replicas": replicas}
    else:
        low, high = min_replicas or 1, max_replicas or max(replicas, min_replicas or 1)
        if not 1 <= low <= high:
            raise ProveError(f"replicas: autoscaling needs 1 <= min_replicas <= max_replicas, got {low}..{high}")
        deployment = {"autoscaling_config": {"min_replicas": low, "max_replicas": high,
                                             "initial_replicas": min(max(replicas, low), high)}}
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    placement: dict[str, Any] = {"bundle_per_worker": {"CPU": cpus_per_worker}}
    if accelerator == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KVCACHE_GIB)
        accelerator_config: dict[str, Any] = {"kind": "cpu"}
        # the engine process does the work; the replica's own actor needs no CPU of its own
        deployment["ray_actor_options"] = {"num_cpus": 0}
    else:
        accelerator_config = {"kind": "gpu"}
        placement["bundle_per_worker"]["GPU"] = 1
    return LLMConfig(model_loading_config={"model_id": model_id or Path(model).name, "model_source": model},
                     engine_kwargs=kwargs, accelerator_config=accelerator_config,
                     placement_group_config=placement, deployment_config=deployment,
                     runtime_env={"env_vars": env}, log_engine_metrics=True)


def build_app(config):
    """Ray Serve LLM's OpenAI-compatible application serving one ``LLMConfig``."""
    from ray.serve.llm import build_openai_app

    # the OpenAI front end only routes: no CPU of its own, so it schedules beside CPU replicas
    return build_openai_app({"llm_configs": [config], "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}}})


def connect(address: str | None = None) -> bool:
    """Join the Ray cluster at ``address``, else start a local one (unless this process is
    already connected); whether this call started Ray (``shutdown`` then stops it)."""
    import ray

    if ray.is_initialized():
        return False
    # "local": a new cluster of this process's own, never one that `ray start` left running here
    ray.init(address=address or "local", include_dashboard=False, log_to_driver=False)
    return address is None


def deploy(app, *, host: str = "127.0.0.1", port: int = 8000, name: str = APP_NAME) -> None:
    """Deploy ``app`` on the connected cluster and wait until every replica is up (a replica that
    fails to start fails this call)."""
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


def serve_forever(app, *, address: str | None = None, host: str = "127.0.0.1", port: int = 8000,
                  name: str = APP_NAME) -> None:
    """Deploy ``app`` and serve until SIGINT / SIGTERM; the application is removed either way."""
    started = connect(address)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        deploy(app, host=host, port=port, name=name)
        print(f"serving the OpenAI API at http://{host}:{port}/v1 (Ctrl-C stops)", flush=True)
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        shutdown(started, name)
