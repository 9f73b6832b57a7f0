"""Server metrics, exposed at /metrics in the Prometheus text format by `prometheus_client`.

Each server has its own registry (several servers in one process, as in tests, do not share counts). Names start
with `eagle3_`; tau is tokens emitted per verification of a drafting row (bonus token included); per-position
acceptance is accepted / tried at each draft depth, computed when scraped.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST  # the format `generate_latest` writes

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
CYCLE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TAU_BUCKETS = (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 10)

# name -> (kind, help, label names or histogram buckets)
METRICS: dict[str, tuple[str, str, tuple]] = {
    "eagle3_requests_total": ("counter", "Finished requests by endpoint and finish reason.",
                              ("endpoint", "finish_reason")),
    "eagle3_request_errors_total": ("counter", "Rejected requests by HTTP status.", ("status",)),
    "eagle3_prompt_tokens_total": ("counter", "Prompt tokens of admitted requests.", ()),
    "eagle3_generation_tokens_total": ("counter", "Generated tokens.", ()),
    "eagle3_verify_steps_total": ("counter", "Batched target verification forwards.", ()),
    "eagle3_verified_tokens_total": ("counter", "Tokens in verification forwards, padding included (B*(N+1)).", ()),
    "eagle3_draft_tokens_total": ("counter", "Draft tokens proposed.", ()),
    "eagle3_accepted_tokens_total": ("counter", "Draft tokens accepted.", ()),
    "eagle3_tool_call_parse_errors_total": ("counter", "Tool calls the model wrote malformed (returned as text).", ()),
    "eagle3_spec_row_steps_total": ("counter", "Row verifications with drafts (the cycles tau is over).", ()),
    "eagle3_spec_paused_cycles_total": ("counter", "Cycles run plain because speculation measured slower.", ()),
    "eagle3_idle_seconds_total": ("counter", "Time the decode loop waited with no request to run.", ()),
    "eagle3_queue_depth": ("gauge", "Requests waiting for a batch slot.", ()),
    "eagle3_running_requests": ("gauge", "Requests in the running batch.", ()),
    "eagle3_spec_draft_tokens": ("gauge", "Draft nodes per drafting row in the last cycle (0: speculation off).", ()),
    "eagle3_drafter_version": ("gauge", "1, labelled with the version of the drafter new requests get (v1: the one "
                                        "loaded at start, then one more per swap; none: no drafter).", ("version",)),
    "eagle3_tau": ("histogram", "Tokens emitted per verification of a drafting row (bonus included).", TAU_BUCKETS),
    "eagle3_batch_size": ("histogram", "Rows per verification forward.", BATCH_BUCKETS),
    "eagle3_cycle_seconds": ("histogram", "Wall time of one decode cycle (draft + verify + accept).", CYCLE_BUCKETS),
    "eagle3_prefill_seconds": ("histogram", "Wall time of one batched prefill of admitted requests (rows wait).",
                               CYCLE_BUCKETS),
    "eagle3_cycle_host_seconds": ("histogram", "Host time of one fast-rows cycle after the device step returned "
                                               "(emitting tokens, detokenizing, streaming, bookkeeping).", CYCLE_BUCKETS),
    "eagle3_time_to_first_token_seconds": ("histogram", "Arrival to first token.", LATENCY_BUCKETS),
    "eagle3_request_latency_seconds": ("histogram", "Arrival to last token.", LATENCY_BUCKETS),
}


_SNAPSHOT = {n for n, (kind, _, extra) in METRICS.items() if kind != "histogram" and not extra} | {
    f"{n}_{part}" for n, (kind, _, _) in METRICS.items() if kind == "histogram" for part in ("sum", "count")}


class _DraftPositions:
    """Per draft depth: row cycles that drafted that deep, those that accepted that many, and their ratio."""

    def __init__(self):
        self.lock = threading.Lock()
        self.tried: dict[int, int] = {}
        self.accepted: dict[int, int] = {}

    def add(self, depth: int, accepted: list[int]) -> None:
        with self.lock:
            for i in range(1, depth + 1):
                self.tried[i] = self.tried.get(i, 0) + len(accepted)
                self.accepted[i] = self.accepted.get(i, 0) + sum(a >= i for a in accepted)

    def collect(self) -> Iterator:
        tried = CounterMetricFamily("eagle3_draft_position_tried", "Row cycles that drafted at depth >= position.",
                                    labels=["position"])
        ok = CounterMetricFamily("eagle3_draft_position_accepted", "Row cycles that accepted >= position drafts.",
                                 labels=["position"])
        rate = GaugeMetricFamily("eagle3_acceptance_rate", "Per-position acceptance: accepted / tried so far.",
                                 labels=["position"])
        with self.lock:
            for i, n in sorted(self.tried.items()):
                tried.add_metric([str(i)], n)
                ok.add_metric([str(i)], self.accepted[i])
                rate.add_metric([str(i)], self.accepted[i] / n if n else 0.0)
        yield from (tried, ok, rate)


class Metrics:
    """All metrics of one server; thread-safe (the scheduler thread and the HTTP handlers update them)."""

    def __init__(self, model_name: str = "model"):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._metrics = {}
        for name, (kind, help_text, extra) in METRICS.items():
            if kind == "histogram":
                self._metrics[name] = Histogram(name, help_text, buckets=extra, registry=self.registry)
            else:
                cls = Counter if kind == "counter" else Gauge
                self._metrics[name] = cls(name, help_text, labelnames=extra, registry=self.registry)
        self._positions = _DraftPositions()
        self.registry.register(self._positions)

    def _child(self, name: str, labels: dict[str, str]):
        m = self._metrics[name]
        return m.labels(**labels) if labels else m

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self._child(name, labels).inc(value)

    def set(self, name: str, value: float, **labels: str) -> None:
        self._child(name, labels).set(value)

    def set_info(self, name: str, **labels: str) -> None:
        """An info-style gauge: 1 for this label set, and no other label set left."""
        m = self._metrics[name]
        m.clear()
        m.labels(**labels).set(1)

    def observe(self, name: str, value: float) -> None:
        self._metrics[name].observe(value)

    def record_row_cycles(self, depth: int, accepted: list[int]) -> None:
        """Drafting rows verified in one cycle at the same depth, each with its count of accepted drafts."""
        tau = self._metrics["eagle3_tau"]
        for a in accepted:
            tau.observe(1 + a)
        self._positions.add(depth, accepted)

    def get(self, name: str, **labels: str) -> float:
        """A counter's or gauge's current value (0 where that label set has none yet)."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def snapshot(self) -> dict[str, float]:
        """Unlabelled counters and gauges, plus histogram sums and counts (for benchmarks), in one collection."""
        return {s.name: s.value for family in self.registry.collect() for s in family.samples
                if s.name in _SNAPSHOT and not s.labels}

    def render(self) -> str:
        return generate_latest(self.registry).decode()
