"""Prometheus text-format metrics, written here (no client library needed)."""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def label_value(value) -> str:
    """A label value as the Prometheus text format writes it (backslash, quote and newline escaped)."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, cum = [], 0
        sep = "," if labels else ""
        for bound, count in zip(self.buckets, self.counts):
            cum += count
            out.append(f'{name}_bucket{{{labels}{sep}le="{bound}"}} {cum}')
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.n}')
        braces = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{braces} {self.total}")
        out.append(f"{name}_count{braces} {self.n}")
        return out


# The engine and pool gauges, one series per model: metric name -> (key in the engine's
# stats, help text). The pool's block counts are named after the block states.
_BLOCK_GAUGES = {f"kv_blocks_{state}": (f"blocks_{state}", help_text) for state, help_text in (
    ("free", "Free KV blocks."),
    ("used", "KV blocks held by sequences."),
    ("shared", "KV blocks shared by several sequences."),
    ("cached", "Evictable prefix-cache blocks."),
)}
GAUGES = {
    "queue_depth": ("waiting_requests", "Requests waiting for admission."),
    "running_sequences": ("running_seqs", "Sequences decoding now."),
    "swapped_requests": ("swapped_requests", "Requests swapped out of the pool."),
    **_BLOCK_GAUGES,
    "kv_utilization": ("utilization", "Tokens stored / slots held in used blocks."),
    "kv_pool_bytes": ("kv_pool_bytes", "Bytes of the KV pool."),
    "kv_bytes_used": ("kv_bytes_used", "KV bytes held by sequences."),
    "prefix_cache_hit_rate": ("prefix_hit_rate", "Prefix-cache block hit rate."),
    "preemptions_total": ("preemptions", "Requests preempted."),
}


class Metrics:
    """Counters and latency histograms updated by the request handlers."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = defaultdict(int)          # (route, status) -> count
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.inflight = defaultdict(int)          # model -> requests admitted, not finished
        self.ttft = Histogram()
        self.itl = Histogram()

    def count_request(self, route: str, status: int) -> None:
        """One answer; route is the route's template (/v1/models/{model}), never the raw path,
        so that probing URLs cannot add series without bound."""
        with self._lock:
            self.requests[(route, status)] += 1

    def admit(self, model: str, capacity: int) -> bool:
        """Count one more request of model in flight if fewer than capacity are (one atomic step)."""
        with self._lock:
            if self.inflight[model] >= capacity:
                return False
            self.inflight[model] += 1
            return True

    def leave(self, model: str) -> None:
        """One request of model is no longer in flight."""
        with self._lock:
            self.inflight[model] -= 1

    def add_tokens(self, prompt: int = 0, generated: int = 0) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.generated_tokens += generated

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        with self._lock:
            self.itl.observe(seconds)

    def render(self, engine_stats: dict[str, dict]) -> str:
        """The /metrics page: our counters plus each model's engine and pool gauges."""
        lines = ["# HELP pyllama_requests_total HTTP requests by route and status.",
                 "# TYPE pyllama_requests_total counter"]
        with self._lock:
            for (route, status), n in sorted(self.requests.items()):
                lines.append(f'pyllama_requests_total{{route="{label_value(route)}",status="{status}"}} {n}')
            lines += ["# TYPE pyllama_prompt_tokens_total counter",
                      f"pyllama_prompt_tokens_total {self.prompt_tokens}",
                      "# TYPE pyllama_generated_tokens_total counter",
                      f"pyllama_generated_tokens_total {self.generated_tokens}",
                      "# HELP pyllama_time_to_first_token_seconds Submit to first token.",
                      "# TYPE pyllama_time_to_first_token_seconds histogram"]
            lines += self.ttft.lines("pyllama_time_to_first_token_seconds", "")
            lines += ["# HELP pyllama_inter_token_latency_seconds Gap between streamed tokens.",
                      "# TYPE pyllama_inter_token_latency_seconds histogram"]
            lines += self.itl.lines("pyllama_inter_token_latency_seconds", "")
        for metric, (key, help_text) in GAUGES.items():
            lines += [f"# HELP pyllama_{metric} {help_text}", f"# TYPE pyllama_{metric} gauge"]
            for model, stats in engine_stats.items():
                if key in stats:
                    lines.append(f'pyllama_{metric}{{model="{label_value(model)}"}} {float(stats[key])}')
        return "\n".join(lines) + "\n"
