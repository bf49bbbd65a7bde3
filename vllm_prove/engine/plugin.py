"""The ``vllm.general_plugins`` entry point: ``prove = "vllm_prove.engine.plugin:register"``.

vLLM calls ``register()`` once in every process it starts (``vllm/plugins/__init__.py:77``):
the front end (``EngineArgs.__post_init__``, ``vllm/engine/arg_utils.py:906``), the engine
core (``vllm/v1/engine/core.py:129``) and each worker, before the worker class is resolved
and before the platform's kernel overrides are registered
(``vllm/v1/worker/worker_base.py:274-286``). It

1. refuses any vLLM but ``SUPPORTED_VLLM`` (a ``RuntimeError`` naming both versions);
2. on the CPU platform, re-registers the fixed expand kernel right after the platform's own
   overrides (``cpu_fixes``): every engine on the CPU samples correctly with drafts;
3. wraps ``EngineArgs.create_engine_config`` so that ``additional_config["prove"]`` is
   validated and turned into vLLM's flags before the config is built (``settings``);
4. wraps ``InputProcessor._validate_params`` so the gated modes refuse, per request, the
   sampling parameters their gate does not implement (a 400 error under ``vllm serve``).

Every wrap is idempotent and a no-op for engines without ``additional_config["prove"]``.
"""

from __future__ import annotations

import functools

from vllm_prove.engine import check_vllm_version

# Attribute marking a function this plugin already wrapped (register() may run again).
_WRAPPED = "_vllm_prove_wrapped"


def register() -> None:
    """Entry point; see the module docstring."""
    check_vllm_version()
    _wrap_cpu_kernel_overrides()
    _wrap_create_engine_config()
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
            return config

        return create_engine_config

    _wrap_once(EngineArgs, "create_engine_config", wrap)


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
