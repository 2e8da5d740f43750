"""Every Prometheus metric family fairserve exports, in one catalogue.

Naming scheme: fairserve_<service>_<what>_<unit>; counters end in _total,
durations are in seconds. Services create their collectors with these names
(prometheus_client strips and re-adds _total itself), docs/metrics.md
documents each family, and the Grafana dashboard queries only these.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.observability.metrics import LATENCY_BUCKETS_S, TOKEN_LATENCY_BUCKETS_S, metric_name

COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"

GATEWAY = "gateway"
SCHEDULER = "scheduler"
WORKER = "worker"
KVCACHE = "kvcache"
SERVICES = (GATEWAY, SCHEDULER, WORKER, KVCACHE)
SUPERVISOR = "supervisor"               # `make run`'s launcher (fairserve/launcher/supervisor.py), no service
EXPORTERS = (*SERVICES, SUPERVISOR)     # everything with a metrics endpoint

HISTOGRAM_SERIES_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class MetricFamily:
    name: str
    kind: str  # COUNTER | GAUGE | HISTOGRAM
    service: str
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()  # histograms only

    def series_names(self) -> tuple[str, ...]:
        """The sample names this family puts in the text exposition."""
        if self.kind == HISTOGRAM:
            return tuple(self.name + suffix for suffix in HISTOGRAM_SERIES_SUFFIXES)
        return (self.name,)



def counter(family: MetricFamily, registry: CollectorRegistry) -> Counter:
    """A live counter for a catalogued family, registered on `registry`."""
    return Counter(family.name, family.help, list(family.labels), registry=registry)


def gauge(family: MetricFamily, registry: CollectorRegistry) -> Gauge:
    return Gauge(family.name, family.help, list(family.labels), registry=registry)


def histogram(family: MetricFamily, registry: CollectorRegistry) -> Histogram:
    return Histogram(family.name, family.help, list(family.labels), buckets=family.buckets,
                     registry=registry)

def _family(service: str, what: str, kind: str, labels: tuple[str, ...], help_text: str,
            buckets: tuple[float, ...] = ()) -> MetricFamily:
    if (kind == HISTOGRAM) != bool(buckets):
        raise ValueError(f"{what}: histograms, and only they, take buckets")
    return MetricFamily(metric_name(service, what), kind, service, labels, help_text, buckets)


# Gateway: HTTP port (GATEWAY_PORT), path /metrics.
GATEWAY_HTTP_REQUESTS = _family(GATEWAY, "http_requests_total", COUNTER, ("method", "route", "code"),
                                "HTTP requests answered, by method, route template and status code")
GATEWAY_HTTP_REQUEST_DURATION = _family(GATEWAY, "http_request_duration_seconds", HISTOGRAM,
                                        ("method", "route"),
                                        "Time to answer an HTTP request (a stream: until its last byte)",
                                        LATENCY_BUCKETS_S)
GATEWAY_REQUESTS = _family(GATEWAY, "requests_total", COUNTER, ("status",),
                           "Generation requests by outcome: stop, length, cancelled, error, rejected")
GATEWAY_IN_FLIGHT = _family(GATEWAY, "in_flight_requests", GAUGE, (),
                            "Generation requests started and not finished yet")
GATEWAY_TTFT = _family(GATEWAY, "ttft_seconds", HISTOGRAM, (),
                       "Time to first token: request received to first token sent", LATENCY_BUCKETS_S)
GATEWAY_TPOT = _family(GATEWAY, "tpot_seconds", HISTOGRAM, (),
                       "Time per output token after the first: (e2e - ttft) / (output tokens - 1)",
                       TOKEN_LATENCY_BUCKETS_S)
GATEWAY_INTER_TOKEN = _family(GATEWAY, "inter_token_latency_seconds", HISTOGRAM, (),
                              "Each gap between two consecutive tokens of a stream",
                              TOKEN_LATENCY_BUCKETS_S)
GATEWAY_E2E = _family(GATEWAY, "e2e_latency_seconds", HISTOGRAM, (),
                      "Request received to last token sent", LATENCY_BUCKETS_S)
GATEWAY_INPUT_TOKENS = _family(GATEWAY, "input_tokens_total", COUNTER, (),
                               "Prompt tokens of finished requests")
GATEWAY_DEPENDENCY_UP = _family(GATEWAY, "dependency_up", GAUGE, ("dependency",),
                                "1 while the service answered the gateway's last probe, else 0: "
                                "scheduler, kvcache")
GATEWAY_OUTPUT_TOKENS = _family(GATEWAY, "output_tokens_total", COUNTER, (),
                                "Generated tokens sent to clients")
GATEWAY_PROMPT_TOKENS_CACHE = _family(GATEWAY, "prompt_tokens_cache_lookups_total", COUNTER, ("result",),
                                      "Prompts looked up in the cache of recent prompts' token ids "
                                      "(PROMPT_TOKENS_CACHE_TOKENS): hit (not tokenized again) or miss")

# Scheduler: SCHEDULER_METRICS_PORT (9101).
SCHEDULER_REQUESTS = _family(SCHEDULER, "requests", GAUGE, ("state",),
                             "Requests by state: pending (queued), prefilling, active (decoding)")
SCHEDULER_ADMITTED = _family(SCHEDULER, "admitted_total", COUNTER, (),
                             "Requests admitted from the queue")
SCHEDULER_FINISHED = _family(SCHEDULER, "finished_total", COUNTER, ("reason",),
                             "Requests finished, by reason: stop, length, cancelled, error")
SCHEDULER_PREEMPTIONS = _family(SCHEDULER, "preemptions_total", COUNTER, (),
                                "Running sequences preempted to free KV blocks")
SCHEDULER_MIGRATIONS = _family(SCHEDULER, "migrations_total", COUNTER, (),
                               "Running requests resumed on another worker after theirs failed")
SCHEDULER_REJECTIONS = _family(SCHEDULER, "rejections_total", COUNTER, ("gate",),
                               "Requests rejected, by gate: queue, never_fit, timeout")
SCHEDULER_ROUTED = _family(SCHEDULER, "routed_total", COUNTER, ("reason",),
                           "Requests placed on a worker, by why that one: `session` (its session's), "
                           "`cache` (the longest cached prefix), `load` (a worker holding a longer prefix "
                           "was overloaded: ROUTING_LOAD_SLACK), `least_loaded` (no cached prefix)")
SCHEDULER_HOLDS = _family(SCHEDULER, "holds_total", COUNTER, ("gate",),
                          "Admissions held back, by gate: active_kv, cache_pool")
SCHEDULER_QUEUE_WAIT = _family(SCHEDULER, "queue_wait_seconds", HISTOGRAM, (),
                               "Time from arrival to admission", LATENCY_BUCKETS_S)
SCHEDULER_RESERVED_KV_TOKENS = _family(SCHEDULER, "reserved_kv_tokens", GAUGE, (),
                                       "KV tokens reserved by admitted requests")
SCHEDULER_WORKER_HEALTHY = _family(SCHEDULER, "worker_healthy", GAUGE, ("worker",),
                                   "1 while the scheduler counts the worker as healthy, else 0")
SCHEDULER_WORKER_STEP = _family(SCHEDULER, "worker_step_seconds", HISTOGRAM, ("worker",),
                                "Step RPC round trip as the scheduler sees it, per worker",
                                TOKEN_LATENCY_BUCKETS_S)
SCHEDULER_WORKER_BATCH_SIZE = _family(SCHEDULER, "worker_batch_size", GAUGE, ("worker",),
                                     "Sequences in the worker's last step, as the scheduler planned it")
SCHEDULER_CLIENT_VTC = _family(SCHEDULER, "client_vtc_tokens", GAUGE, ("client",),
                               "Virtual token counter of each fairness client (weighted tokens)")
SCHEDULER_CLIENT_SERVED_TOKENS = _family(SCHEDULER, "client_served_tokens_total", COUNTER, ("client",),
                                         "Tokens served to each fairness client")
SCHEDULER_KV_INDEX_UP = _family(SCHEDULER, "kv_index_up", GAUGE, (),
                                "1 while routing uses the KV index; 0 while its lookups fail and are paused")
SCHEDULER_PEERS = _family(SCHEDULER, "peers", GAUGE, ("state",),
                          "Scheduler shards named in SCHEDULER_PEERS, by whether they answer this one's reads "
                          "(answering, silent)")
SCHEDULER_POLICY = _family(SCHEDULER, "policy_info", GAUGE, ("policy",),
                           "Always 1; the label names the scheduling policy")

# Worker: WORKER_METRICS_PORT (9102); every family carries the worker label.
WORKER_STEP = _family(WORKER, "step_seconds", HISTOGRAM, ("worker",), "Forward time per step",
                      TOKEN_LATENCY_BUCKETS_S)
WORKER_BATCH_TOKENS = _family(WORKER, "batch_tokens", GAUGE, ("worker",), "Tokens in the last step")
WORKER_BATCH_SEQUENCES = _family(WORKER, "batch_sequences", GAUGE, ("worker",),
                                 "Sequences in the last step (the batch size)")
WORKER_TOKENS = _family(WORKER, "tokens_total", COUNTER, ("worker", "kind"),
                        "Tokens by kind: computed (forward passes), prompt (the computed ones at prompt "
                        "positions), sampled")
WORKER_KV_BLOCKS = _family(WORKER, "kv_blocks", GAUGE, ("worker", "state"),
                           "KV blocks by state: free, cached, used, total")
WORKER_KV_EVICTIONS = _family(WORKER, "kv_evictions_total", COUNTER, ("worker",),
                              "Cached blocks evicted")
WORKER_PREFIX_HIT_TOKENS = _family(WORKER, "prefix_cache_hit_tokens_total", COUNTER, ("worker",),
                                   "Prompt tokens served from the prefix cache")
WORKER_PREFIX_QUERY_TOKENS = _family(WORKER, "prefix_cache_query_tokens_total", COUNTER, ("worker",),
                                     "Prompt tokens looked up in the prefix cache")
WORKER_RUNNING = _family(WORKER, "running_sequences", GAUGE, ("worker",), "Sequences holding KV blocks")
WORKER_PROMPT_LOGITS_HITS = _family(WORKER, "prompt_logits_hits_total", COUNTER, ("worker",),
                                    "Identical prompts whose first token came from their kept last position, with no layer run")
WORKER_GRAPH_STEPS = _family(WORKER, "decode_graph_steps_total", COUNTER, ("worker",),
                             "Decode steps whose forward replayed a captured CUDA graph")
WORKER_SPECULATIVE_TOKENS = _family(WORKER, "speculative_tokens_total", COUNTER, ("worker", "kind"),
                                    "Speculative (n-gram) draft tokens verified (drafted) and kept (accepted)")
WORKER_LOGITS_ROWS = _family(WORKER, "logits_rows_total", COUNTER, ("worker", "path"),
                             "Sampled rows by how their logits were computed: screened (int8 screen, "
                             "exact where greedy/top-k can land) or full (the whole LM head)")
WORKER_ENGINE_INFO = _family(WORKER, "engine_info", GAUGE,
                             ("worker", "device", "dtype", "linear_kernel", "prefill_attention",
                              "decode_attention"),
                             "Always 1; the labels name the engine's device, dtype and kernels")

# KV cache index: KVCACHE_METRICS_PORT (9103).
KVCACHE_LOOKUPS = _family(KVCACHE, "lookups_total", COUNTER, (), "Prefix lookups answered")
KVCACHE_HITS = _family(KVCACHE, "hits_total", COUNTER, (), "Lookups that matched at least one block")
KVCACHE_LOOKUP_TOKENS = _family(KVCACHE, "lookup_tokens_total", COUNTER, (), "Prompt tokens looked up")
KVCACHE_HIT_TOKENS = _family(KVCACHE, "hit_tokens_total", COUNTER, (),
                             "Looked-up tokens found cached on the best worker")
KVCACHE_HIT_RATE = _family(KVCACHE, "hit_rate", GAUGE, (),
                           "hit_tokens / lookup_tokens since start (0 before any lookup)")
KVCACHE_NODES = _family(KVCACHE, "nodes", GAUGE, (), "Nodes in the prefix index")
KVCACHE_BLOCKS = _family(KVCACHE, "blocks", GAUGE, ("worker",), "Blocks the index holds for each worker")
KVCACHE_EVENTS = _family(KVCACHE, "events_total", COUNTER, (), "Block events applied")
KVCACHE_RESYNCS = _family(KVCACHE, "resyncs_total", COUNTER, (), "Full resyncs received from workers")

# Supervisor (`make run`'s launcher): SUPERVISOR_METRICS_PORT (9104).
SUPERVISOR_RESTARTS = _family(SUPERVISOR, "restarts_total", COUNTER, ("service",),
                              "Times a service was started again after it exited")
SUPERVISOR_START_TIME = _family(SUPERVISOR, "start_time_seconds", GAUGE, ("service",),
                                "Unix time the service's current process was started")

ALL_FAMILIES: tuple[MetricFamily, ...] = tuple(
    value for value in globals().copy().values() if isinstance(value, MetricFamily))


def families_of(service: str) -> tuple[MetricFamily, ...]:
    return tuple(family for family in ALL_FAMILIES if family.service == service)


def family_of_series(series_name: str) -> MetricFamily | None:
    """The catalogued family a sample name belongs to, if any."""
    for family in ALL_FAMILIES:
        if series_name in family.series_names():
            return family
    return None
