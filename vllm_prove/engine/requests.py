"""Which path decodes a request in the gated modes, decided in the front end per request.

The gate of the verifier/MARS modes replaces vLLM's sampler on window steps (``gate_runner``):
it decodes greedily from the raw window logits and returns no log probabilities. A request
the gate cannot decode exactly (temperature > 0, logprobs, ``n > 1``, penalties, structured
output, logit bias, ...) is by default decoded in the same batch by vLLM's own sampler
without windows (plain decoding: ``on_unsupported = "fallback"``); with
``on_unsupported = "refuse"`` it is refused with an error naming the fields: a ``ValueError``
for ``LLM`` users and a ``VLLMValidationError``, which vLLM's server answers with 400
(``vllm/exceptions.py:28``). Lossless mode keeps vLLM's sampler and accepts everything.

What the gate supports is derived from ``SamplingParams`` itself: every field not at its
default value makes a request not gate-able, except the fields listed in ``GATE_NEUTRAL``
(they do not change which token is chosen), so a field a new vLLM release adds is covered
without an edit here.
"""

from __future__ import annotations

from vllm.exceptions import VLLMValidationError

from vllm_prove.engine.settings import engine_settings

# SamplingParams fields that never change which token a greedy step picks: lengths, stops,
# output formatting and bookkeeping. (`temperature` is judged by the sampling type; top-k,
# top-p, min-p and seed only matter when sampling.)
GATE_NEUTRAL = frozenset({
    "max_tokens", "stop", "stop_token_ids", "ignore_eos", "detokenize", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "output_kind", "stream_interval",
    "skip_clone", "output_text_buffer_length", "extra_args", "skip_reading_prefix_cache",
    "routed_experts_prompt_start", "trace_decode_token_ids", "flat_logprobs",
    "temperature", "top_p", "top_k", "min_p", "seed",
})
FALLBACK = "fallback"  # ProveEngineConfig.on_unsupported values
REFUSE = "refuse"


_PATH_COUNTER = None  # prometheus_client Counter, created on the first gated-mode request


def count_path(path: str) -> None:
    """``vllm_prove:requests_total{path="gate"|"fallback"}`` on vLLM's ``/metrics`` (the front
    end's default Prometheus registry): which path decoded how many requests."""
    global _PATH_COUNTER
    if _PATH_COUNTER is None:
        from prometheus_client import Counter

        _PATH_COUNTER = Counter("vllm_prove:requests", "Requests of a gated ProVe mode by decoding path "
                                "(gate: windows and the gate; fallback: vLLM's sampler, no window)", ["path"])
    _PATH_COUNTER.labels(path=path).inc()


class GatedModeRequestError(VLLMValidationError, ValueError):
    """A request asks a gated mode with ``on_unsupported = "refuse"`` for what its gate lacks."""


def _at_default(value, default) -> bool:
    """Whether a field's value means "off" like its default: equal, ``False`` for a ``None``
    default (the engine resolves e.g. ``watermarking=None`` to ``False``), or an empty
    container for an empty default. ``logprobs=0`` is not off (it asks for a logprob)."""
    if value == default:
        return True
    if default is None:
        return value is False
    if isinstance(default, (list, tuple, set, dict)) and not default:
        return not value
    return False


def unsupported_gated_params(params) -> list[str]:
    """Names of the ``SamplingParams`` fields that keep the gate from decoding ``params``."""
    from vllm.sampling_params import SamplingParams, SamplingType

    default = SamplingParams()
    unsupported = ["temperature"] if params.sampling_type != SamplingType.GREEDY else []
    for name in SamplingParams.__struct_fields__:
        if name.startswith("_") or name in GATE_NEUTRAL:
            continue
        if not _at_default(getattr(params, name), getattr(default, name)):
            unsupported.append(name)
    return unsupported


def gate_serves(params) -> bool:
    """Whether the gate decodes a request with ``params`` (else the fallback path does)."""
    return not unsupported_gated_params(params)


def request_gate_serves(request) -> bool:
    """`gate_serves` of a scheduler ``Request`` or a runner ``CachedRequestState``, computed once
    per request and kept on it (its sampling params never change; the scheduler and the runner
    ask every step)."""
    verdict = getattr(request, "_prove_gate_serves", None)
    if verdict is None:
        verdict = gate_serves(request.sampling_params)
        request._prove_gate_serves = verdict
    return verdict


def check_params(vllm_config, params) -> None:
    """Refuse, in ``on_unsupported = "refuse"`` engines, a request the gate cannot decode;
    count the path of every other request of a gated mode."""
    from vllm.sampling_params import SamplingParams

    settings = engine_settings(vllm_config)
    if settings is None or not settings.mode.gated or not isinstance(params, SamplingParams):
        return
    unsupported = unsupported_gated_params(params)
    if unsupported and settings.on_unsupported == REFUSE:
        raise GatedModeRequestError(
            f"ProVe mode {settings.mode.value!r} decodes greedily through its gate and does not support "
            f"{', '.join(unsupported)}; use temperature=0 and leave these unset, or start the engine with "
            "on_unsupported='fallback' (the default) to decode such requests without the gate",
            parameter=unsupported[0],
        )
    count_path("fallback" if unsupported else "gate")
