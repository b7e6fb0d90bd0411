"""Prometheus text-format metrics, written here (no client library needed): our own
pyllama_* names, and beside them the vllm:* names and labels that routers and dashboards
made for vLLM read (load-aware and cache-aware routing, autoscalers)."""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def label_value(value) -> str:
    """A label value as the Prometheus text format writes it (backslash, quote and newline escaped)."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


# vLLM's buckets for the same measures, so that its dashboards' quantiles read ours alike
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                     10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)


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
    # speculative decoding (only while an engine speculates)
    "spec_draft_tokens_total": ("spec_draft_tokens", "Draft tokens proposed and verified."),
    "spec_accepted_tokens_total": ("spec_accepted_tokens", "Draft tokens accepted."),
    "spec_draft_forward_seconds_total": ("spec_draft_forward_seconds", "Seconds in the draft model's forward steps."),
    "spec_draft_kv_blocks_used": ("spec_draft_blocks_used", "Draft model KV blocks held by draft sequences."),
    # the prefix cache's tiers below the pool (only while an engine has them)
    "prefix_tier_hit_tokens_total": ("prefix_tier_hits", "Prompt tokens restored from the RAM or disk tier."),
    "prefix_tier_ram_hit_blocks_total": ("tier_ram_hit_blocks", "Blocks restored from the RAM tier."),
    "prefix_tier_disk_hit_blocks_total": ("tier_disk_hit_blocks", "Blocks restored from the disk tier."),
    "prefix_tier_saved_blocks_total": ("tier_saved_blocks", "Computed blocks written to the tiers."),
    "prefix_tier_ram_bytes": ("tier_ram_bytes", "Bytes held by the RAM tier."),
    "prefix_tier_disk_bytes": ("tier_disk_bytes", "Bytes of block files in the disk tier's directory."),
    "prefix_tier_disk_corrupt_files_total": ("tier_disk_corrupt_files", "Damaged block files found (misses)."),
}


class ModelCounters:
    """What the request handlers saw of one model, for its vllm:* series."""

    def __init__(self):
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(VLLM_TTFT_BUCKETS)
        self.e2e = Histogram(VLLM_E2E_BUCKETS)


# vLLM's series read from each engine's stats: (name, type, help, value of the stats).
# vLLM counts preempted requests among the waiting ones; we keep them apart as swapped.
VLLM_ENGINE_SERIES = (
    ("vllm:num_requests_running", "gauge", "Requests admitted to the KV pool and being computed.",
     lambda s: s.get("running_requests", 0)),
    ("vllm:num_requests_waiting", "gauge", "Requests waiting for admission or swapped out.",
     lambda s: s.get("waiting_requests", 0) + s.get("swapped_requests", 0)),
    ("vllm:kv_cache_usage_perc", "gauge", "Fraction of KV blocks held by sequences (0..1).",
     lambda s: s.get("blocks_used", 0) / s["blocks_total"] if s.get("blocks_total") else 0.0),
    ("vllm:prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache.",
     lambda s: s.get("prefix_cache_queries", 0)),
    ("vllm:prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache.",
     lambda s: s.get("prefix_cache_hits", 0)),
    ("vllm:num_preemptions", "counter", "Requests preempted.",
     lambda s: s.get("preemptions", 0)),
)


def vllm_labels(model: str) -> str:
    """vLLM's labels of a series: the served model's name and the engine's index (one engine)."""
    return f'model_name="{label_value(model)}",engine="0"'


def _vllm_family(name: str, kind: str, help_text: str) -> list[str]:
    # a counter's family is named with the _total its samples carry, as prometheus_client writes it
    family = f"{name}_total" if kind == "counter" else name
    return [f"# HELP {family} {help_text}", f"# TYPE {family} {kind}"]


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
        self.models: dict[str, ModelCounters] = defaultdict(ModelCounters)

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

    def add_tokens(self, prompt: int = 0, generated: int = 0, model: str | None = None) -> None:
        """Tokens of an ended request, counted for the server and (named) for its model."""
        with self._lock:
            self.prompt_tokens += prompt
            self.generated_tokens += generated
            if model is not None:
                counters = self.models[model]
                counters.prompt_tokens += prompt
                counters.generation_tokens += generated

    def observe_ttft(self, seconds: float, model: str | None = None) -> None:
        """Submit to first token, for the server and (named) for its model."""
        with self._lock:
            self.ttft.observe(seconds)
            if model is not None:
                self.models[model].ttft.observe(seconds)

    def observe_e2e(self, model: str, seconds: float) -> None:
        """Submit to end of one request of model (vLLM's e2e request latency)."""
        with self._lock:
            self.models[model].e2e.observe(seconds)

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
        lines += self._vllm_lines(engine_stats)
        return "\n".join(lines) + "\n"

    def _vllm_lines(self, engine_stats: dict[str, dict]) -> list[str]:
        """vLLM's series: its engine gauges and counters for each loaded model, then its token
        counters and latency histograms for each model that was asked something."""
        lines = []
        for name, kind, help_text, value in VLLM_ENGINE_SERIES:
            lines += _vllm_family(name, kind, help_text)
            suffix = "_total" if kind == "counter" else ""
            lines += [f"{name}{suffix}{{{vllm_labels(model)}}} {float(value(stats))}"
                      for model, stats in engine_stats.items()]
        with self._lock:
            models = sorted(self.models.items())
            for name, field_name, help_text in (
                    ("vllm:prompt_tokens", "prompt_tokens", "Prompt tokens of answered requests."),
                    ("vllm:generation_tokens", "generation_tokens", "Tokens generated.")):
                lines += _vllm_family(name, "counter", help_text)
                lines += [f"{name}_total{{{vllm_labels(model)}}} {float(getattr(c, field_name))}" for model, c in models]
            for name, field_name, help_text in (
                    ("vllm:time_to_first_token_seconds", "ttft", "Submit to first token, in seconds."),
                    ("vllm:e2e_request_latency_seconds", "e2e", "Submit to end of request, in seconds.")):
                lines += _vllm_family(name, "histogram", help_text)
                for model, c in models:
                    lines += getattr(c, field_name).lines(name, vllm_labels(model))
        return lines
