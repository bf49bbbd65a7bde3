"""Per-request checks of the gated modes, run in the front end before a request is queued.

The gate of the verifier/MARS modes replaces vLLM's sampler on window steps
(``gate_runner``): it decodes greedily from the raw window logits and returns no log
probabilities. Parameters that need the sampler are therefore refused with an error naming
them instead of being silently ignored: a ``ValueError`` for ``LLM`` users and a
``VLLMValidationError``, which vLLM's server answers with 400 (``vllm/exceptions.py:28``).
Lossless mode keeps vLLM's sampler and accepts everything vLLM accepts.
"""

from __future__ import annotations

from vllm.exceptions import VLLMValidationError

from vllm_prove.engine.settings import engine_settings


class GatedModeRequestError(VLLMValidationError, ValueError):
    """A request asks the gated modes for something their gate does not implement."""


def unsupported_gated_params(params) -> list[str]:
    """Names of the ``SamplingParams`` fields set to something the gate cannot honour."""
    from vllm.sampling_params import SamplingType

    checks = {
        "temperature": params.sampling_type != SamplingType.GREEDY,
        "logprobs": params.logprobs is not None,
        "prompt_logprobs": params.prompt_logprobs is not None,
        "structured_outputs": params.structured_outputs is not None,
        "presence_penalty": params.presence_penalty != 0.0,
        "frequency_penalty": params.frequency_penalty != 0.0,
        "repetition_penalty": params.repetition_penalty != 1.0,
        "min_tokens": params.min_tokens > 0,
        "logit_bias": bool(params.logit_bias),
        "allowed_token_ids": params.allowed_token_ids is not None,
        "bad_words": bool(params.bad_words),
    }
    return [name for name, unsupported in checks.items() if unsupported]


def check_params(vllm_config, params) -> None:
    """Raise ``ValueError`` for a request the engine's ProVe mode cannot decode faithfully."""
    from vllm.sampling_params import SamplingParams

    settings = engine_settings(vllm_config)
    if settings is None or not settings.mode.gated or not isinstance(params, SamplingParams):
        return
    unsupported = unsupported_gated_params(params)
    if unsupported:
        raise GatedModeRequestError(
            f"ProVe mode {settings.mode.value!r} decodes greedily through its gate and does not support "
            f"{', '.join(unsupported)}; use temperature=0 and leave these unset (lossless mode supports them)",
            parameter=unsupported[0],
        )
