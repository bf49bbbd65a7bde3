"""ProVe's numbers read off vLLM's own spec-decode metrics (no counter of our own).

Every mode reports through vLLM's standard accounting (``scheduler.py:2110-2150``): per
cycle, ``num_draft_tokens`` drafts and ``num_accepted = len(committed) - 1``. So in every
mode

- committed tokens per cycle = ``1 + num_accepted_tokens / num_drafts`` (vLLM's "mean
  acceptance length"; in lossless mode the 1 is the recovered/bonus token, in the gated modes
  it is y_1, which the gate always commits);
- ``accepted_per_position[j] / num_drafts`` = share of cycles that accepted draft ``j + 1``
  (gated modes: that committed at least ``j + 2`` tokens).

Aggregates: ``LLM(..., disable_log_stats=False).get_metrics()`` or ``/metrics``
(``vllm:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
``..._num_accepted_tokens_total``, ``..._num_accepted_tokens_per_pos_total{position=j}``).
Per request: ``per_request_spec_decode_metrics="summary"`` (or ``"detailed"``) puts vLLM's
``RequestSpecDecodeMetrics`` on ``RequestOutput.outputs[0].spec_decode_metrics``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

PREFIX = "vllm:spec_decode_"


@dataclass(frozen=True)
class SpecDecodeSummary:
    """Cycles and acceptance of one engine (cumulative) or one request."""

    num_drafts: int  # cycles that verified drafts (windows, in the gated modes)
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def committed_per_cycle(self) -> float:
        """Mean tokens committed by a cycle: ``1 + accepted / drafts``."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """Share of cycles that accepted draft position ``j`` (0-based)."""
        return [count / self.num_drafts for count in self.accepted_per_position] if self.num_drafts else []

    def __sub__(self, earlier: SpecDecodeSummary) -> SpecDecodeSummary:
        """What happened between two snapshots of cumulative counters."""
        width = len(self.accepted_per_position)
        earlier_per_position = earlier.accepted_per_position + [0] * (width - len(earlier.accepted_per_position))
        return SpecDecodeSummary(
            num_drafts=self.num_drafts - earlier.num_drafts,
            num_draft_tokens=self.num_draft_tokens - earlier.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - earlier.num_accepted_tokens,
            accepted_per_position=[a - b for a, b in zip(self.accepted_per_position, earlier_per_position)],
        )

    def to_json(self) -> dict:
        return {
            "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens, "accepted_per_position": self.accepted_per_position,
            "committed_per_cycle": round(self.committed_per_cycle, 4),
            "acceptance_per_position": [round(x, 4) for x in self.acceptance_per_position],
        }


def from_engine_metrics(metrics: Iterable) -> SpecDecodeSummary:
    """From ``LLM.get_metrics()`` (``vllm/v1/metrics/reader.py`` Counter / Vector objects)."""
    values: dict[str, object] = {}
    for metric in metrics:
        if metric.name.startswith(PREFIX):
            values[metric.name.removeprefix(PREFIX)] = getattr(metric, "values", getattr(metric, "value", None))
    return SpecDecodeSummary(
        num_drafts=int(values.get("num_drafts", 0)),
        num_draft_tokens=int(values.get("num_draft_tokens", 0)),
        num_accepted_tokens=int(values.get("num_accepted_tokens", 0)),
        accepted_per_position=[int(v) for v in values.get("num_accepted_tokens_per_pos", [])],
    )


def from_prometheus_text(text: str) -> SpecDecodeSummary:
    """From the body of ``GET /metrics`` (summed over engines and label sets)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    per_position: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(PREFIX) or not sample.name.endswith("_total"):
                continue
            name = sample.name.removeprefix(PREFIX).removesuffix("_total")
            if name == "num_accepted_tokens_per_pos":
                position = int(sample.labels["position"])
                per_position[position] = per_position.get(position, 0.0) + sample.value
            else:
                totals[name] = totals.get(name, 0.0) + sample.value
    return SpecDecodeSummary(
        num_drafts=int(totals.get("num_drafts", 0)),
        num_draft_tokens=int(totals.get("num_draft_tokens", 0)),
        num_accepted_tokens=int(totals.get("num_accepted_tokens", 0)),
        accepted_per_position=[int(per_position[j]) for j in sorted(per_position)],
    )


def from_request(spec_decode_metrics) -> SpecDecodeSummary:
    """From one ``RequestOutput.outputs[0].spec_decode_metrics`` (``RequestSpecDecodeMetrics``)."""
    histogram = list(spec_decode_metrics.histogram)  # cycles by number of accepted drafts
    num_positions = len(histogram) - 1
    accepted_per_position = [sum(histogram[j + 1:]) for j in range(num_positions)]
    return SpecDecodeSummary(
        num_drafts=sum(histogram),
        num_draft_tokens=spec_decode_metrics.num_draft_tokens,
        num_accepted_tokens=sum(j * count for j, count in enumerate(histogram)),
        accepted_per_position=accepted_per_position,
    )
