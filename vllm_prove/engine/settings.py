"""``additional_config["prove"]`` -> validated settings -> vLLM's own flags, at start-up.

Everything here runs in the front-end process, inside ``EngineArgs.create_engine_config``
(wrapped by ``plugin.register``), before vLLM builds its config or spawns a process. A bad
value therefore stops start-up with a ``ValueError`` naming the field: pydantic's message
for the ranges of ``ProveEngineConfig``, and the checks below for what needs the model
folders (the proposer's mask token, the verifier's vocabulary).

The settings decide vLLM's flags, so the user writes only ``additional_config``:

| mode | speculative_config filled in | worker | scheduler |
| --- | --- | --- | --- |
| lossless | draft_model = the served model, K = B, parallel_drafting, probabilistic drafts | ProVe | adaptive |
| verifier | draft_model = the verifier, K = B - 1 (its KV shares the block table) | ProVe | ProVe |
| mars | draft_model = the served model (never loaded twice), K = B - 1 | ProVe | ProVe |
| sd | the user's own draft_model ``speculative_config``, K = its num_speculative_tokens | ProVe | adaptive |
| sdd | draft_model = the diffusion drafter, K = gamma = block_size | ProVe | SDD |

In lossless and sd mode the scheduler is ``AdaptiveScheduler`` (load-adaptive depth) unless
``adaptive`` is false. The fixed depth then runs ``seeded.SeededScheduler``, vLLM's synchronous
scheduler scheduling seeded requests whole (``seeded.WholeSeededSteps``, as every ProVe
scheduler of a sampling mode does, so that a seeded request's text does not depend on its
batch), wherever vLLM schedules synchronously: with ``async_scheduling=False``, and on CPU,
whose platform turns asynchronous scheduling off (``vllm/platforms/cpu.py``). Where vLLM would
schedule asynchronously (GPU, by default) the fixed depth keeps vLLM's own ``AsyncScheduler``.
A ``speculative_config`` given by the user must agree with this (a conflict names the key).

ProVe can also be turned on through ``--speculative-config`` alone: ``{"model":
"vllm_prove.lossless", "num_speculative_tokens": 8}`` (or ``vllm_prove.verifier`` /
``vllm_prove.mars``, with ``num_speculative_tokens = B - 1``) becomes the mode and block size
of ``additional_config["prove"]``, whose other keys (theta, verifier, ...) still apply.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from vllm_prove.config import EngineMode, ProveEngineConfig
from vllm_prove.engine import check_vllm_version
from vllm_prove.errors import ProveError

# additional_config key that carries the settings (part of vLLM's config hash).
PROVE_KEY = "prove"
SCHEDULER_CLS = "vllm_prove.engine.scheduler.ProveScheduler"
ADAPTIVE_SCHEDULER_CLS = "vllm_prove.engine.adaptive.AdaptiveScheduler"
SDD_SCHEDULER_CLS = "vllm_prove.engine.diffusion.SDDScheduler"
SEEDED_SCHEDULER_CLS = "vllm_prove.engine.seeded.SeededScheduler"
CPU_WORKER_CLS = "vllm_prove.engine.worker.ProveCPUWorker"
GPU_WORKER_CLS = "vllm_prove.engine.worker.ProveGPUWorker"


# `speculative_config["model"]` names that select a ProVe mode (`--speculative-config`).
SPECULATIVE_MODELS = {f"vllm_prove.{mode.value}": mode for mode in EngineMode
                      if mode not in (EngineMode.SD, EngineMode.SDD)}


def settings_from_speculative_config(args) -> None:  # args: EngineArgs, mutable
    """Move a ``speculative_config`` naming a ProVe mode into ``additional_config["prove"]``."""
    spec = dict(args.speculative_config or {})
    mode = SPECULATIVE_MODELS.get(spec.get("model"))
    if mode is None:
        return
    prove = dict((args.additional_config or {}).get(PROVE_KEY) or {})
    if prove.get("mode", mode.value) != mode.value:
        raise ProveError(f"mode: speculative_config['model'] = {spec['model']!r} selects {mode.value!r} but "
                         f"additional_config['{PROVE_KEY}']['mode'] = {prove['mode']!r}")
    prove["mode"] = mode.value
    del spec["model"]
    if spec.get("method") in ("custom_class", "draft_model"):
        del spec["method"]
    k = spec.pop("num_speculative_tokens", None)
    if k is not None:
        block_size = k if mode is EngineMode.LOSSLESS else k + 1
        if prove.get("block_size", block_size) != block_size:
            raise ProveError(f"block_size: speculative_config['num_speculative_tokens'] = {k} means block_size "
                             f"{block_size} in mode {mode.value!r}, but additional_config['{PROVE_KEY}'] says "
                             f"{prove['block_size']}")
        prove["block_size"] = block_size
    args.speculative_config = spec or None
    args.additional_config = {**(args.additional_config or {}), PROVE_KEY: prove}


def parse_settings(additional_config: dict[str, Any] | None) -> ProveEngineConfig | None:
    """The ``"prove"`` entry of ``additional_config`` as validated settings; None if absent."""
    raw = (additional_config or {}).get(PROVE_KEY)
    if raw is None:
        return None
    try:
        return ProveEngineConfig.model_validate(raw)
    except ValidationError as err:
        raise ProveError(f"additional_config['{PROVE_KEY}'] is invalid: {err}") from err


def engine_settings(vllm_config) -> ProveEngineConfig | None:
    """The settings of a built ``VllmConfig`` (already resolved by ``prepare_engine_args``)."""
    return parse_settings(vllm_config.additional_config)


def _hf_config(path: str, trust_remote_code: bool):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


def resolve_mask_token_id(settings: ProveEngineConfig, model: str, trust_remote_code: bool) -> int:
    """``settings.mask_token_id``, else the served model's ``config.json`` ``mask_token_id``."""
    if settings.mask_token_id is not None:
        return settings.mask_token_id
    mask_token_id = getattr(_hf_config(model, trust_remote_code), "mask_token_id", None)
    if mask_token_id is None:
        raise ProveError(
            f"mask_token_id: the proposer {model!r} has no `mask_token_id` in its config.json and "
            f"additional_config['{PROVE_KEY}'] gives none; every ProVe mode feeds mask placeholders"
        )
    return int(mask_token_id)


def resolve_verifier(settings: ProveEngineConfig, user_spec: dict[str, Any], model: str, trust_remote_code: bool) -> str:
    """The verifier folder (``verifier`` or ``speculative_config["model"]``), vocabulary checked."""
    verifier = settings.verifier or user_spec.get("model")
    if verifier is None or verifier == model:
        raise ProveError(
            "verifier: mode='verifier' needs a small verifier model: set "
            f"additional_config['{PROVE_KEY}']['verifier'] (or speculative_config['model']) to its folder"
        )
    if settings.verifier is not None and user_spec.get("model") not in (None, settings.verifier):
        raise ProveError(f"verifier: {settings.verifier!r} disagrees with speculative_config['model'] = {user_spec['model']!r}")
    proposer_vocab = _hf_config(model, trust_remote_code).vocab_size
    verifier_vocab = _hf_config(verifier, trust_remote_code).vocab_size
    if verifier_vocab != proposer_vocab:
        raise ProveError(
            f"verifier: vocabulary size {verifier_vocab} of {verifier!r} != {proposer_vocab} of the proposer "
            f"{model!r}; the verifier must share the proposer's tokenizer"
        )
    return verifier


def resolve_sdd_drafter(settings: ProveEngineConfig, model: str, trust_remote_code: bool) -> int:
    """Mode ``sdd``: the drafter's mask id, after checking drafter against target (one vocabulary,
    one mask id) and its kind (vLLM runs the KV-cached block drafter)."""
    from transformers import AutoTokenizer

    from vllm_prove.reference.drafter import resolve_drafter

    target_tok = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    mask_token_id, spec = resolve_drafter(settings.drafter, target_tok, settings.mask_token_id)
    kind = spec.get("kind", "block")
    if kind != "block":
        raise ProveError(f"drafter: {settings.drafter!r} is a {kind!r} diffusion drafter (every pass re-reads the "
                         "whole context bidirectionally); inside vLLM only the KV-cached 'block' kind runs. Use the "
                         "reference engine (`vllm-prove generate --engine reference`) for it")
    drafter_vocab = _hf_config(settings.drafter, True).vocab_size
    target_vocab = _hf_config(model, trust_remote_code).vocab_size
    if drafter_vocab != target_vocab:
        raise ProveError(f"drafter: vocabulary size {drafter_vocab} of {settings.drafter!r} != {target_vocab} of "
                         f"the target {model!r}; vLLM verifies drafts of one vocabulary")
    return mask_token_id


def resolve_sd_settings(settings: ProveEngineConfig, user_spec: dict[str, Any]) -> ProveEngineConfig:
    """Mode ``sd``: vLLM's draft-model SD as the user configured it; ``block_size`` is its K."""
    if user_spec.get("method", "draft_model") != "draft_model" or not user_spec.get("model"):
        raise ProveError("mode: 'sd' runs vLLM's draft-model speculative decoding under the adaptive depth; give "
                         "speculative_config={'method': 'draft_model', 'model': DRAFT, 'num_speculative_tokens': K}")
    k = user_spec.get("num_speculative_tokens")
    if k is None:
        return settings
    if "block_size" in settings.model_fields_set and settings.block_size != k:
        raise ProveError(f"block_size: {settings.block_size} disagrees with speculative_config"
                         f"['num_speculative_tokens'] = {k} (mode 'sd': the block is the K drafts)")
    try:
        return ProveEngineConfig.model_validate({**settings.model_dump(), "block_size": k})
    except ValidationError as err:
        raise ProveError(f"speculative_config['num_speculative_tokens'] = {k}: {err}") from err


def speculative_config_for(settings: ProveEngineConfig, model: str, verifier: str | None) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for a mode (see the module table; ``sd`` keeps the user's model)."""
    spec: dict[str, Any] = {"method": "draft_model", "num_speculative_tokens": settings.num_speculative_tokens}
    if settings.mode is EngineMode.SD:
        return spec
    if settings.mode is EngineMode.SDD:
        return spec | {"model": settings.drafter}
    if settings.mode is EngineMode.LOSSLESS:
        # The mask-pass distributions become the draft probabilities of vLLM's rejection
        # sampler (llm_base_proposer.py:258): exact speculative sampling at temperature > 0.
        return spec | {"model": model, "parallel_drafting": True, "draft_sample_method": "probabilistic"}
    return spec | {"model": verifier if settings.mode is EngineMode.VERIFIER else model}


def merge_speculative_config(expected: dict[str, Any], user_spec: dict[str, Any], settings: ProveEngineConfig) -> dict[str, Any]:
    """The user's ``speculative_config`` completed by ``expected``; a disagreement is an error."""
    for key, value in expected.items():
        if key in user_spec and user_spec[key] != value:
            hint = f" (block_size={settings.block_size}, mode={settings.mode.value!r})" if key == "num_speculative_tokens" else ""
            raise ProveError(
                f"speculative_config['{key}'] = {user_spec[key]!r} conflicts with ProVe's {value!r}{hint}; "
                "leave it out and the plugin fills it in"
            )
    return {**user_spec, **expected}


def check_tensor_parallel(user_spec: dict[str, Any], tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
    """Proposer and verifier must be sharded alike: in every mode the draft's attention layers
    write into the target's KV blocks (one block table, one slot mapping per rank), and the
    gate reads logits that every rank has in full. vLLM's default (draft TP = target TP) is
    that; a different ``draft_tensor_parallel_size`` is refused here. Pipeline stages would
    split the window pass from the verifier and the gate (only the last stage has logits):
    refused too (docs/design/multi_gpu.md)."""
    if pipeline_parallel_size > 1:
        raise ProveError(f"pipeline_parallel_size = {pipeline_parallel_size}: ProVe supports tensor parallelism only; "
                         "use tensor_parallel_size (or one engine per replica)")
    draft_tp = user_spec.get("draft_tensor_parallel_size")
    if draft_tp is not None and draft_tp != tensor_parallel_size:
        raise ProveError(
            f"speculative_config['draft_tensor_parallel_size'] = {draft_tp}: ProVe shards the verifier like the "
            f"proposer (tensor_parallel_size = {tensor_parallel_size}); leave it out"
        )


def _set_engine_class(args, name: str, value: str, stock: tuple[Any, ...]) -> None:
    current = getattr(args, name)
    if current not in stock + (value,):
        raise ProveError(f"{name}: ProVe installs {value!r}; a custom {name} {current!r} cannot be combined with it")
    setattr(args, name, value)


def prepare_engine_args(args) -> ProveEngineConfig | None:  # args: vllm.engine.arg_utils.EngineArgs, mutable
    """Validate the settings and write vLLM's flags into ``args``; None when ProVe is off."""
    settings_from_speculative_config(args)
    settings = parse_settings(args.additional_config)
    if settings is None:
        return None
    check_vllm_version()  # the adapters below use private internals of one vLLM release
    user_spec = dict(args.speculative_config or {})
    if settings.mode is EngineMode.SD:
        settings = resolve_sd_settings(settings, user_spec)
        mask_token_id = settings.mask_token_id  # vLLM's SD feeds no placeholder
    elif settings.mode is EngineMode.SDD:
        mask_token_id = resolve_sdd_drafter(settings, args.model, args.trust_remote_code)
    else:
        mask_token_id = resolve_mask_token_id(settings, args.model, args.trust_remote_code)
    verifier = None
    if settings.mode is EngineMode.VERIFIER:
        verifier = resolve_verifier(settings, user_spec, args.model, args.trust_remote_code)
    check_tensor_parallel(user_spec, args.tensor_parallel_size, args.pipeline_parallel_size)
    expected = speculative_config_for(settings, args.model, verifier)
    args.speculative_config = merge_speculative_config(expected, user_spec, settings)
    resolved = settings.model_copy(update={"mask_token_id": mask_token_id, "verifier": verifier})
    args.additional_config = {**args.additional_config, PROVE_KEY: resolved.model_dump(mode="json")}
    from vllm.platforms import current_platform

    worker_cls = CPU_WORKER_CLS if current_platform.is_cpu() else GPU_WORKER_CLS
    _set_engine_class(args, "worker_cls", worker_cls, ("auto",))
    # The fixed depth keeps vLLM's asynchronous scheduler where vLLM would run one; where it
    # schedules synchronously anyway (asked to, or on CPU, whose platform turns it off) it gets
    # the synchronous one that schedules seeded requests whole.
    synchronous = args.async_scheduling is False or (args.async_scheduling is None and current_platform.is_cpu())
    scheduler_cls = (SCHEDULER_CLS if settings.mode.gated else SDD_SCHEDULER_CLS if settings.mode is EngineMode.SDD
                     else ADAPTIVE_SCHEDULER_CLS if settings.adaptive_on
                     else SEEDED_SCHEDULER_CLS if synchronous else None)
    if scheduler_cls is not None:
        _set_engine_class(args, "scheduler_cls", scheduler_cls, (None, "vllm.v1.core.sched.scheduler.Scheduler"))
        if args.async_scheduling:
            why = ("the gated ProVe modes roll back num_computed_tokens" if settings.mode.gated else
                   "mode 'sdd' commits skipped tokens the target has not read yet" if settings.mode is EngineMode.SDD
                   else "the adaptive depth times each step and decides the next one (set adaptive=false to keep it)")
            raise ProveError(f"async_scheduling: {why} in a synchronous scheduler")
        args.async_scheduling = False
    return resolved


def install_executor(vllm_config, settings: ProveEngineConfig) -> None:
    """With the adaptive depth, vLLM's resolved ``"mp"`` / ``"uni"`` executor becomes its
    ``executor`` twin that skips the draft round trip of plain steps; any other backend (Ray, an
    external launcher, the user's own class) is left as it is."""
    if not settings.adaptive_on:
        return
    from vllm_prove.engine.executor import EXECUTORS

    parallel_config = vllm_config.parallel_config
    backend = parallel_config.distributed_executor_backend
    if isinstance(backend, str) and backend in EXECUTORS:
        parallel_config.distributed_executor_backend = EXECUTORS[backend]


def check_engine_config(vllm_config, settings: ProveEngineConfig) -> None:
    """Checks that need vLLM's resolved config (after ``create_engine_config``)."""
    speculative_config = vllm_config.speculative_config
    if settings.adaptive_on and speculative_config is not None and speculative_config.num_speculative_tokens_per_batch_size:
        raise ProveError(
            "num_speculative_tokens_per_batch_size: vLLM's static batch-size table conflicts with the adaptive "
            "depth, which decides every step's depths from measured costs; drop the table, or set "
            '"adaptive": false in the prove section to use it'
        )
    if not settings.mode.gated:
        return
    scheduler_config = vllm_config.scheduler_config
    # The scheduler's token budget (vLLM may lower it below max_num_batched_tokens to leave
    # room for drafts, vllm/config/vllm.py:2276) loses B - 1 tokens to the window reserve of
    # ProveScheduler and must still fit one window step [u, mask x (B-1)] of B tokens.
    budget = scheduler_config.max_num_scheduled_tokens or scheduler_config.max_num_batched_tokens
    minimum = 2 * settings.block_size - 1
    if budget < minimum:
        raise ProveError(
            f"max_num_batched_tokens: a token budget of {budget} per step is too small for "
            f"block_size={settings.block_size}; the gated ProVe modes need at least 2 * block_size - 1 = {minimum}"
        )
