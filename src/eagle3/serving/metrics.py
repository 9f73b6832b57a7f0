"""Server metrics in the Prometheus text exposition format (version 0.0.4), without a client library.

Counters, gauges and histograms are updated by the scheduler thread and the HTTP handlers under one lock;
`Metrics.render()` writes them all. Names start with `eagle3_`; tau is tokens emitted per verification of a
drafting row (bonus token included), per-position acceptance is accepted / tried at each draft depth.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict

__all__ = ["Metrics"]

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
CYCLE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TAU_BUCKETS = (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 10)


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{v}"' for k, v in labels)
    return "{" + body + "}"


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
        self.total += 1
        self.sum += value


METRICS: dict[str, tuple[str, str]] = {  # name -> (type, help)
    "eagle3_requests_total": ("counter", "Finished requests by endpoint and finish reason."),
    "eagle3_request_errors_total": ("counter", "Rejected requests by HTTP status."),
    "eagle3_prompt_tokens_total": ("counter", "Prompt tokens of admitted requests."),
    "eagle3_generation_tokens_total": ("counter", "Generated tokens."),
    "eagle3_verify_steps_total": ("counter", "Batched target verification forwards."),
    "eagle3_verified_tokens_total": ("counter", "Tokens in verification forwards, padding included (B*(N+1))."),
    "eagle3_draft_tokens_total": ("counter", "Draft tokens proposed."),
    "eagle3_accepted_tokens_total": ("counter", "Draft tokens accepted."),
    "eagle3_tool_call_parse_errors_total": ("counter", "Tool calls the model wrote malformed (returned as text)."),
    "eagle3_spec_row_steps_total": ("counter", "Row verifications with drafts (the cycles tau is over)."),
    "eagle3_spec_paused_cycles_total": ("counter", "Cycles run plain because speculation measured slower."),
    "eagle3_draft_position_tried_total": ("counter", "Row cycles that drafted at depth >= position."),
    "eagle3_draft_position_accepted_total": ("counter", "Row cycles that accepted >= position drafts."),
    "eagle3_acceptance_rate": ("gauge", "Per-position acceptance: accepted / tried so far."),
    "eagle3_queue_depth": ("gauge", "Requests waiting for a batch slot."),
    "eagle3_running_requests": ("gauge", "Requests in the running batch."),
    "eagle3_spec_draft_tokens": ("gauge", "Draft nodes per drafting row in the last cycle (0: speculation off)."),
    "eagle3_drafter_version": ("gauge", "1, labelled with the version of the drafter new requests get (v1: the one "
                                        "loaded at start, then one more per swap; none: no drafter)."),
    "eagle3_idle_seconds_total": ("counter", "Time the decode loop waited with no request to run."),
    "eagle3_tau": ("histogram", "Tokens emitted per verification of a drafting row (bonus included)."),
    "eagle3_batch_size": ("histogram", "Rows per verification forward."),
    "eagle3_cycle_seconds": ("histogram", "Wall time of one decode cycle (draft + verify + accept)."),
    "eagle3_prefill_seconds": ("histogram", "Wall time of one batched prefill of admitted requests (rows wait)."),
    "eagle3_cycle_host_seconds": ("histogram", "Host time of one fast-rows cycle after the device step returned "
                                               "(emitting tokens, detokenizing, streaming, bookkeeping)."),
    "eagle3_time_to_first_token_seconds": ("histogram", "Arrival to first token."),
    "eagle3_request_latency_seconds": ("histogram", "Arrival to last token."),
}
_UNLABELLED = tuple(n for n, (kind, _) in METRICS.items() if kind != "histogram" and n not in (
    "eagle3_requests_total", "eagle3_request_errors_total", "eagle3_draft_position_tried_total",
    "eagle3_draft_position_accepted_total", "eagle3_acceptance_rate", "eagle3_drafter_version"))
_BUCKETS: dict[str, tuple[float, ...]] = {
    "eagle3_tau": TAU_BUCKETS,
    "eagle3_batch_size": BATCH_BUCKETS,
    "eagle3_cycle_seconds": CYCLE_BUCKETS,
    "eagle3_prefill_seconds": CYCLE_BUCKETS,
    "eagle3_cycle_host_seconds": CYCLE_BUCKETS,
    "eagle3_time_to_first_token_seconds": LATENCY_BUCKETS,
    "eagle3_request_latency_seconds": LATENCY_BUCKETS,
}


class Metrics:
    """All server metrics; thread-safe."""

    def __init__(self, model_name: str = "model"):
        self.model_name = model_name
        self._lock = threading.Lock()
        self._values: dict[str, dict[tuple, float]] = defaultdict(dict)
        self._hists: dict[str, _Histogram] = {k: _Histogram(b) for k, b in _BUCKETS.items()}
        for name in _UNLABELLED:
            self._values[name][()] = 0.0

    # -- updates ---------------------------------------------------------------------------
    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[name][key] = self._values[name].get(key, 0.0) + value

    def set(self, name: str, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[name][key] = float(value)

    def set_info(self, name: str, **labels: str) -> None:
        """An info-style gauge: 1 for this label set, and no other label set left."""
        with self._lock:
            self._values[name] = {tuple(sorted(labels.items())): 1.0}

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self._hists[name].observe(value)

    def record_row_cycle(self, depth: int, accepted: int) -> None:
        """One drafting row's verification: tree depth drafted and drafts accepted."""
        self.record_row_cycles(depth, [accepted])

    def record_row_cycles(self, depth: int, accepted: list[int]) -> None:
        """Drafting rows verified in one cycle at the same depth, each with its count of accepted drafts."""
        with self._lock:
            tau = self._hists["eagle3_tau"]
            tried = self._values["eagle3_draft_position_tried_total"]
            ok = self._values["eagle3_draft_position_accepted_total"]
            for a in accepted:
                tau.observe(1 + a)
            for i in range(1, depth + 1):
                key = (("position", str(i)),)
                tried[key] = tried.get(key, 0.0) + len(accepted)
                ok[key] = ok.get(key, 0.0) + sum(a >= i for a in accepted)

    def get(self, name: str, **labels: str) -> float:
        key = tuple(sorted(labels.items()))
        with self._lock:
            return self._values[name].get(key, 0.0)

    def snapshot(self) -> dict[str, float]:
        """Unlabelled counters and gauges, plus histogram sums and counts (for benchmarks)."""
        with self._lock:
            out = {n: v[()] for n, v in self._values.items() if () in v}
            for n, h in self._hists.items():
                out[f"{n}_sum"], out[f"{n}_count"] = h.sum, h.total
            return out

    # -- exposition ------------------------------------------------------------------------
    def render(self) -> str:
        lines: list[str] = []
        with self._lock:
            tried = self._values.get("eagle3_draft_position_tried_total", {})
            ok = self._values.get("eagle3_draft_position_accepted_total", {})
            self._values["eagle3_acceptance_rate"] = {k: (ok.get(k, 0.0) / t if t else 0.0) for k, t in tried.items()}
            for name, (kind, help_text) in METRICS.items():
                lines.append(f"# HELP {name} {help_text}")
                lines.append(f"# TYPE {name} {kind}")
                if kind == "histogram":
                    h = self._hists[name]
                    for b, c in zip(h.buckets, h.counts, strict=True):
                        lines.append(f'{name}_bucket{{le="{_num(b)}"}} {c}')
                    lines.append(f'{name}_bucket{{le="+Inf"}} {h.total}')
                    lines.append(f"{name}_sum {_num(h.sum)}")
                    lines.append(f"{name}_count {h.total}")
                    continue
                for key, v in sorted(self._values.get(name, {}).items()):
                    lines.append(f"{name}{_labels(key)} {_num(v)}")
        return "\n".join(lines) + "\n"
