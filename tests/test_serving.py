"""`vllm_prove.serving`: one method's settings -> a Ray Serve LLM config, checked before deploying."""

from __future__ import annotations

import json

import pytest

from vllm_prove import serving
from vllm_prove.cli import main
from vllm_prove.config import DecodeConfig
from vllm_prove.errors import ProveError
from vllm_prove.paths import zoo_path


def test_lossless_replicas_carry_the_plugin_mode_and_cpu_bundles():
    engine = serving.replica_engine(DecodeConfig(method="prove-lossless", block_size=6), max_num_seqs=16)
    config = serving.llm_config(engine, replicas=2, accelerator="cpu")
    kwargs = config.engine_kwargs
    assert kwargs["additional_config"] == {"prove": {"mode": "lossless", "block_size": 6, "adaptive": True}}
    assert kwargs["max_num_seqs"] == 16 and kwargs["dtype"] == "float32" and "model" not in kwargs
    assert config.model_loading_config.model_source == zoo_path("proposer")
    assert config.model_loading_config.model_id == "proposer"
    assert config.deployment_config["num_replicas"] == 2
    assert config.deployment_config["ray_actor_options"] == {"num_cpus": 0}
    assert config.placement_group_config == {"bundle_per_worker": {"CPU": 1.0}, "strategy": "STRICT_PACK"}
    assert config.accelerator_config.kind == "cpu"
    assert config.runtime_env["env_vars"]["VLLM_CPU_KVCACHE_SPACE"]


def test_autoscaling_bounds_and_gpu_bundles():
    engine = serving.replica_engine(DecodeConfig(method="sd", k=3), max_num_seqs=8, tensor_parallel_size=2)
    config = serving.llm_config(engine, min_replicas=0, max_replicas=4, replicas=2, accelerator="gpu")
    # a replica is added when each holds more requests than its engine's batch
    assert config.deployment_config == {"autoscaling_config": {"min_replicas": 0, "max_replicas": 4,
                                                               "initial_replicas": 2, "target_ongoing_requests": 8}}
    assert config.placement_group_config == {"bundle_per_worker": {"CPU": 1.0, "GPU": 1}}
    assert config.engine_kwargs["tensor_parallel_size"] == 2
    assert config.engine_kwargs["speculative_config"]["num_speculative_tokens"] == 3
    with pytest.raises(ProveError, match="min_replicas <= max_replicas"):
        serving.llm_config(serving.replica_engine(DecodeConfig(method="ar")), min_replicas=3, max_replicas=2,
                           accelerator="cpu")


@pytest.mark.parametrize("prove, field", [({"mode": "lossless", "block_size": 1}, "block_size"),
                                          ({"mode": "verifier", "theta": 1.5}, "theta"),
                                          ({"mode": "lossless", "blocksize": 8}, "blocksize")])
def test_a_bad_setting_fails_before_deploying_naming_the_field(prove, field, capsys, monkeypatch):
    import ray

    def deployed(*args, **kwargs):
        raise AssertionError("a bad setting reached deployment")

    monkeypatch.setattr(serving, "serve_forever", deployed)
    rc = main(["serve-ray", "--method", "prove-lossless", "--accelerator", "cpu",
               "--engine-kwargs", json.dumps({"additional_config": {"prove": prove}})])
    err = capsys.readouterr().err
    assert rc == 2 and field in err, err
    assert not ray.is_initialized()  # refused before any cluster was joined or started


def test_a_vllm_setting_the_plugin_refuses_fails_before_deploying():
    with pytest.raises(ProveError, match="async_scheduling"):
        serving.replica_engine(DecodeConfig(method="prove"), engine_overrides={"async_scheduling": True})
    # the OpenAI front end's flags (Ray Serve LLM takes them in engine_kwargs too) are the replicas' to check
    engine = serving.replica_engine(DecodeConfig(method="ar"), engine_overrides={"chat_template": "{{ messages }}"})
    assert engine["chat_template"] == "{{ messages }}"
