"""The ``vllm.general_plugins`` entry point: ``prove = "vllm_prove.engine.plugin:register"``.

vLLM calls ``register()`` once in every process it starts (``vllm/plugins/__init__.py:77``):
the front end (``EngineArgs.__post_init__``, ``vllm/engine/arg_utils.py:906``), the engine
core (``vllm/v1/engine/core.py:129``) and each worker, before the worker class is resolved
and before the platform's kernel overrides are registered
(``vllm/v1/worker/worker_base.py:274-286``).

A plug-in is a guest in every vLLM process of the environment, so for an engine that did not
ask for ProVe it changes nothing but one thing, the CPU sampling fixes (2.): no version check,
no environment variable, no other behaviour. It

1. wraps ``EngineArgs.create_engine_config`` so that ``additional_config["prove"]`` is
   validated and turned into vLLM's flags before the config is built (``settings``), and an
   engine with the adaptive depth gets vLLM's resolved executor without the draft round trip of
   plain steps (``executor``); that is where a vLLM other than ``SUPPORTED_VLLM`` is refused (a
   ``RuntimeError`` naming both versions), for ProVe engines only;
2. on the CPU platform with the supported vLLM, re-registers the fixed expand kernel right
   after the platform's own overrides (``cpu_fixes``): every engine on the CPU, ProVe or not,
   samples correctly with drafts (the bench tables say their vLLM baselines run so);
3. wraps ``VllmConfig.use_v2_model_runner`` so a ProVe engine's own config selects Model
   Runner V1 (its ``_sample`` hook); other engines keep vLLM's choice;
4. wraps ``InputProcessor._validate_params`` so the gated modes refuse, per request, the
   sampling parameters their gate does not implement (a 400 error under ``vllm serve``).

Every wrap is idempotent and a no-op for engines without ``additional_config["prove"]``.
With another vLLM release only (1.) is installed: the private hooks of (2.-4.) are not touched.
"""

from __future__ import annotations

import functools

from vllm_prove.engine import vllm_version_supported

# Attribute marking a function this plugin already wrapped (register() may run again).
_WRAPPED = "_vllm_prove_wrapped"


def register() -> None:
    """Entry point; see the module docstring."""
    _wrap_create_engine_config()
    if not vllm_version_supported():  # ProVe engines are refused in create_engine_config
        return
    _wrap_cpu_kernel_overrides()
    _wrap_model_runner_choice()
    _wrap_validate_params()


def _wrap_once(owner, name: str, wrap, as_classmethod: bool = False) -> None:
    """Replace ``owner.name`` by ``wrap(original)`` unless this plugin already did
    (``register()`` runs in every process, and may run twice in one)."""
    original = getattr(owner, name)  # a bound method for a classmethod: reads its function's marker
    if getattr(original, _WRAPPED, False):
        return
    wrapped = wrap(original)
    setattr(wrapped, _WRAPPED, True)
    setattr(owner, name, classmethod(wrapped) if as_classmethod else wrapped)


def _wrap_cpu_kernel_overrides() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return

    def wrap(original):
        def register_triton_kernel_overrides(cls) -> None:
            original()
            from vllm_prove.engine import cpu_fixes

            cpu_fixes.apply()

        return register_triton_kernel_overrides

    _wrap_once(type(current_platform), "register_triton_kernel_overrides", wrap, as_classmethod=True)


def _wrap_create_engine_config() -> None:
    from vllm.engine.arg_utils import EngineArgs

    def wrap(original):
        @functools.wraps(original)
        def create_engine_config(self, *args, **kwargs):
            from vllm_prove.engine import settings

            prove = settings.prepare_engine_args(self)
            config = original(self, *args, **kwargs)
            if prove is not None:
                settings.check_engine_config(config, prove)
                settings.install_executor(config, prove)
            return config

        return create_engine_config

    _wrap_once(EngineArgs, "create_engine_config", wrap)


def _wrap_model_runner_choice() -> None:
    from vllm.config import VllmConfig

    from vllm_prove.engine.settings import PROVE_KEY

    original = VllmConfig.__dict__["use_v2_model_runner"]  # a property; vllm/config/vllm.py
    if getattr(original.fget, _WRAPPED, False):
        return

    def use_v2_model_runner(self) -> bool:
        if PROVE_KEY in (self.additional_config or {}):
            return False  # ProVe's runner mixins hook Model Runner V1's `_sample`
        return original.fget(self)

    setattr(use_v2_model_runner, _WRAPPED, True)
    VllmConfig.use_v2_model_runner = property(use_v2_model_runner, doc=original.__doc__)


def _wrap_validate_params() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    def wrap(original):
        @functools.wraps(original)
        def _validate_params(self, params, *args, **kwargs):
            from vllm_prove.engine import requests

            requests.check_params(self.vllm_config, params)
            return original(self, params, *args, **kwargs)

        return _validate_params

    _wrap_once(InputProcessor, "_validate_params", wrap)
