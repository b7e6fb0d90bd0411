"""The /metrics page, written by prometheus_client from one CollectorRegistry per app:
our own pyllama_* names, and beside them the vllm:* names and labels that routers and
dashboards made for vLLM read (load-aware and cache-aware routing, autoscalers)."""

from __future__ import annotations

import threading
from collections import defaultdict

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# vLLM's buckets for the same measures, so that its dashboards' quantiles read ours alike
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                     10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's labels of a series: the served model's name and the engine's index (one engine per model)
VLLM_LABELS = ("model_name", "engine")

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
    "prefix_tier_disk_skipped_writes_total": ("tier_disk_skipped_writes",
                                              "Blocks not written: the disk had less than its reserve free."),
}

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
_FAMILIES = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}


class Metrics:
    """What the request handlers count and time, in an app's own CollectorRegistry (several
    apps live in one process: never the global one). The counts tests and admission read
    (requests, tokens, requests in flight) are kept here and written by collect(), with
    each engine's figures; the latencies and vLLM's per-model tokens are prometheus_client's."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = defaultdict(int)          # (route, status) -> count
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.inflight = defaultdict(int)          # model -> requests admitted, not finished
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)   # first: the request counts head the page
        self._scrape = threading.Lock()
        self._engine_stats: dict[str, dict] = {}  # the engines' figures while a page is written
        r = self.registry
        self.ttft = Histogram("pyllama_time_to_first_token_seconds", "Submit to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pyllama_inter_token_latency_seconds", "Gap between streamed tokens.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of answered requests.",
                                          VLLM_LABELS, registry=r)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", VLLM_LABELS, registry=r)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Submit to first token, in seconds.",
                                   VLLM_LABELS, buckets=VLLM_TTFT_BUCKETS, registry=r)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "Submit to end of request, in seconds.",
                                  VLLM_LABELS, buckets=VLLM_E2E_BUCKETS, registry=r)

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
            self.vllm_prompt_tokens.labels(model, "0").inc(prompt)
            self.vllm_generation_tokens.labels(model, "0").inc(generated)

    def observe_ttft(self, seconds: float, model: str | None = None) -> None:
        """Submit to first token, for the server and (named) for its model."""
        self.ttft.observe(seconds)
        if model is not None:
            self.vllm_ttft.labels(model, "0").observe(seconds)

    def observe_e2e(self, model: str, seconds: float) -> None:
        """Submit to end of one request of model (vLLM's e2e request latency)."""
        self.vllm_e2e.labels(model, "0").observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        """One gap between streamed tokens."""
        self.itl.observe(seconds)

    def render(self, engine_stats: dict[str, dict]) -> bytes:
        """The /metrics page (Prometheus' text format): the registry's series, with each
        loaded model's engine and pool figures (engine_stats: model name -> stats)."""
        with self._scrape:
            self._engine_stats = engine_stats
            try:
                return generate_latest(self.registry)
            finally:
                self._engine_stats = {}

    def collect(self):
        """The series kept here (prometheus_client's collector protocol): request and token
        counts, then the engines' gauges and vLLM's engine series."""
        requests = CounterMetricFamily("pyllama_requests", "HTTP requests by route and status.",
                                       labels=("route", "status"))
        with self._lock:
            for (route, status), n in sorted(self.requests.items()):
                requests.add_metric((route, str(status)), n)
            tokens = (("pyllama_prompt_tokens", "Prompt tokens of answered requests.", self.prompt_tokens),
                      ("pyllama_generated_tokens", "Tokens generated.", self.generated_tokens))
        yield requests
        for name, help_text, n in tokens:
            yield CounterMetricFamily(name, help_text, value=n)
        stats = self._engine_stats
        for metric, (key, help_text) in GAUGES.items():
            family = GaugeMetricFamily(f"pyllama_{metric}", help_text, labels=("model",))
            for model, figures in stats.items():
                if key in figures:
                    family.add_metric((model,), float(figures[key]))
            yield family
        for name, kind, help_text, value in VLLM_ENGINE_SERIES:
            family = _FAMILIES[kind](name, help_text, labels=VLLM_LABELS)
            for model, figures in stats.items():
                family.add_metric((model, "0"), float(value(figures)))
            yield family
