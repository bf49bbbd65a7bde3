"""Engine-free arithmetic of `vllm-prove eval`: confidence intervals, answer normalization,
per-engine speed attribution. Pure Python + numpy; no vLLM, no Ray.

- Bootstrap CIs (docs/METHODS.md §8: accuracy deltas are read against 95% intervals from a
  paired bootstrap with 10,000 resamples): ``bootstrap_ci`` for one method's mean score,
  ``paired_bootstrap_ci`` for the difference of two methods scored on the same items (the
  items are resampled, both methods' scores move together).
- Answers (the SDD paper, appendix A.5, its MATH protocol): the last balanced ``\\boxed{...}``
  expression, else the final signed integer or decimal; LaTeX wrappers and spacing, currency
  and percent signs and numeric formatting normalized; then exact string comparison (no
  symbolic equivalence).
- Speed (methods.md §8): tokens / in-flight seconds of the engine. ``attributed_seconds``
  splits an engine's busy time among the requests in flight (each of k concurrent requests is
  charged dt / k), so per-task seconds add up exactly to the engine's in-flight time.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

BOOTSTRAP_RESAMPLES = 10_000
CI_LEVEL = 0.95


def _scores(name: str, values: Sequence[float]) -> np.ndarray:  # [num_items] float64
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{name}: need a non-empty 1-D sequence of per-item scores, got shape {array.shape}")
    return array


def _interval(samples: np.ndarray, level: float) -> tuple[float, float]:
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(samples, [tail, 100 - tail])
    return float(low), float(high)


def bootstrap_ci(scores: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0,
                 level: float = CI_LEVEL) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean per-item score."""
    values = _scores("scores", scores)  # [num_items]
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, values.size, size=(resamples, values.size))  # [resamples, num_items]
    return _interval(values[picks].mean(axis=1), level)


def paired_bootstrap_ci(scores: Sequence[float], baseline: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES,
                        seed: int = 0, level: float = CI_LEVEL) -> tuple[float, float]:
    """Percentile interval of ``mean(scores) - mean(baseline)``, items resampled in pairs."""
    a, b = _scores("scores", scores), _scores("baseline", baseline)  # [num_items] each
    if a.size != b.size:
        raise ValueError(f"paired bootstrap needs the same items: {a.size} scores vs {b.size} baseline scores")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, a.size, size=(resamples, a.size))  # [resamples, num_items]
    return _interval((a - b)[picks].mean(axis=1), level)


# -- answers (SDD paper, appendix A.5) ---------------------------------------------------------

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
_WRAPPERS = ("\\text", "\\textbf", "\\mathrm", "\\mathbf", "\\mbox", "\\displaystyle")


def last_boxed(text: str) -> str | None:
    """Content of the last balanced ``\\boxed{...}`` (or ``\\fbox{...}``); None if there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[brace + 1: i]
    return None  # unbalanced: not an answer


def extract_answer(completion: str) -> str | None:
    """The last balanced boxed expression, else the final signed integer or decimal."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def _unwrap(text: str, command: str) -> str:
    """``\\text{abc}`` -> ``abc`` for every occurrence of ``command`` with a balanced argument."""
    while (start := text.find(command + "{")) >= 0:
        depth, end = 0, None
        for i in range(start + len(command), len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                end = i
                break
        if end is None:
            break
        text = text[:start] + text[start + len(command) + 1: end] + text[end + 1:]
    return text


def normalize_answer(answer: str) -> str:
    """Canonical string of an answer: LaTeX wrappers, spacing, ``$``/``%``, ``\\!``, thousands
    separators, trailing zeros and a trailing period removed; ``\\dfrac``/``\\tfrac`` -> ``\\frac``."""
    text = answer.strip()
    for command in _WRAPPERS:
        text = _unwrap(text, command)
    text = text.replace("\\left", "").replace("\\right", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for token in ("\\$", "$", "\\%", "%", "\\!", "\\,", "\\;", "\\ ", "^\\circ", "^{\\circ}"):
        text = text.replace(token, "")
    text = re.sub(r"\s+", "", text).rstrip(".")
    if re.fullmatch(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[-+]?\.\d+", text):  # a plain number
        value = text.replace(",", "").lstrip("+")
        if "." in value:
            value = value.rstrip("0").rstrip(".")
        value = value or "0"
        if value.startswith("-."):
            value = "-0" + value[1:]
        elif value.startswith("."):
            value = "0" + value
        return "0" if value in ("-0", "+0") else value
    return text


def answer_correct(completion: str, reference: str) -> bool:
    """Normalized exact match of the completion's extracted answer against the reference
    (the reference itself goes through the same extraction if it is a worked solution)."""
    predicted = extract_answer(completion)
    if predicted is None:
        return False
    target = last_boxed(reference)
    return normalize_answer(predicted) == normalize_answer(reference if target is None else target)


# -- speed -------------------------------------------------------------------------------------

def busy_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end]`` intervals: the time an engine had work."""
    total, reach = 0.0, -np.inf
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def attributed_seconds(intervals: Sequence[tuple[float, float]]) -> list[float]:
    """Each request's share of the engine's busy time: while k requests are in flight, each
    is charged dt / k. The shares sum to ``busy_seconds(intervals)``; one request alone gets
    its whole interval."""
    events = sorted({t for interval in intervals for t in interval})
    shares = [0.0] * len(intervals)
    for left, right in zip(events, events[1:]):
        live = [i for i, (start, end) in enumerate(intervals) if start <= left and end >= right]
        for i in live:
            shares[i] += (right - left) / len(live)
    return shares
