"""The server's Prometheus metrics: requests, tokens, speculation and latency, per drafter.

Counters are cumulative; ratios (acceptance, mean accepted length) are Prometheus expressions over
them, e.g. ``verispec_accepted_tokens_total / verispec_drafted_tokens_total``, plus gauges that give
the same ratios over the server's lifetime for a glance at ``/metrics`` without a query language.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from verispec.stats import GenerationStats

# Latency buckets (seconds) sized for CPU decoding: tokens take milliseconds to a second, first tokens
# (queue wait and prefill included) up to minutes under load.
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0)
FIRST_TOKEN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class Metrics:
    """One registry per server (tests run several in one process)."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        ProcessCollector(registry=registry)  # process_resident_memory_bytes, CPU seconds, open fds
        method = ["method"]
        self.requests = Counter("verispec_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=registry)
        self.rejected = Counter("verispec_rejected_requests", "Requests refused because the queue was full (429)",
                                registry=registry)
        self.cancelled = Counter("verispec_cancelled_requests", "Admitted requests whose client went away",
                                 registry=registry)
        self.completed = Counter("verispec_completed_requests", "Generations run to their end", method,
                                 registry=registry)
        self.queue_depth = Gauge("verispec_queue_depth", "Admitted requests waiting for the decoder",
                                 registry=registry)
        self.running = Gauge("verispec_running_requests", "Requests being decoded now", registry=registry)
        self.prompt_tokens = Counter("verispec_prompt_tokens", "Prompt tokens prefilled", method, registry=registry)
        self.generated = Counter("verispec_generation_tokens", "Tokens generated", method, registry=registry)
        self.target_calls = Counter("verispec_target_calls", "Target forward passes (prefill included)", method,
                                    registry=registry)
        self.draft_calls = Counter("verispec_draft_calls", "Draft forward passes", method, registry=registry)
        self.drafted = Counter("verispec_drafted_tokens", "Candidate tokens proposed", method, registry=registry)
        self.accepted = Counter("verispec_accepted_tokens", "Candidate tokens the target kept", method,
                                registry=registry)
        self.drafted_at = Counter("verispec_drafted_tokens_by_position", "Candidates proposed at each position "
                                  "(0 = first)", ["method", "position"], registry=registry)
        self.accepted_at = Counter("verispec_accepted_tokens_by_position", "Candidates kept at each position",
                                   ["method", "position"], registry=registry)
        self.steps = Counter("verispec_decode_steps", "Decode steps (target calls after the prefill)", method,
                             registry=registry)
        self.acceptance = Gauge("verispec_acceptance_rate", "Accepted / drafted tokens over the server's lifetime",
                                method, registry=registry)
        self.mean_accepted_length = Gauge("verispec_mean_accepted_length", "Tokens per decode step over the "
                                          "server's lifetime (counting the recovered or bonus token)", method,
                                          registry=registry)
        self.first_token = Histogram("verispec_time_to_first_token_seconds", "Admission to first token (queue "
                                     "wait and prefill included)", method, buckets=FIRST_TOKEN_BUCKETS,
                                     registry=registry)
        self.per_token = Histogram("verispec_time_per_output_token_seconds", "Mean time per token after the "
                                   "first, per request", method, buckets=TOKEN_BUCKETS, registry=registry)
        self.latency = Histogram("verispec_request_seconds", "Admission to last token", method,
                                 buckets=FIRST_TOKEN_BUCKETS, registry=registry)
        self._pooled: dict[str, GenerationStats] = {}  # per method

    def record_run(self, stats: GenerationStats, first_token_seconds: float, total_seconds: float) -> None:
        """One finished generation (its stats) and the latencies its client saw."""
        m = stats.method
        self.completed.labels(m).inc()
        self.prompt_tokens.labels(m).inc(stats.prompt_tokens)
        self.generated.labels(m).inc(stats.new_tokens)
        self.target_calls.labels(m).inc(stats.target_calls)
        self.draft_calls.labels(m).inc(stats.draft_calls)
        self.drafted.labels(m).inc(stats.drafted_tokens)
        self.accepted.labels(m).inc(stats.accepted_tokens)
        self.steps.labels(m).inc(stats.decode_steps)
        for i, (drafted, accepted) in enumerate(zip(stats.drafted_by_position or [], stats.accepted_by_position or [])):
            self.drafted_at.labels(m, str(i)).inc(drafted)
            self.accepted_at.labels(m, str(i)).inc(accepted)
        # The lifetime ratios under GenerationStats' own definitions, from pooled counts.
        pooled = self._pooled.setdefault(m, GenerationStats(method=m))
        pooled.drafted_tokens += stats.drafted_tokens
        pooled.accepted_tokens += stats.accepted_tokens
        pooled.decode_steps += stats.decode_steps
        pooled.decode_step_tokens += stats.decode_step_tokens
        if pooled.acceptance_rate is not None:
            self.acceptance.labels(m).set(pooled.acceptance_rate)
        if pooled.mean_accepted_length is not None:
            self.mean_accepted_length.labels(m).set(pooled.mean_accepted_length)
        self.first_token.labels(m).observe(first_token_seconds)
        self.latency.labels(m).observe(total_seconds)
        if stats.new_tokens > 1:
            self.per_token.labels(m).observe((total_seconds - first_token_seconds) / (stats.new_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
