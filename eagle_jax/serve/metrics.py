"""Prometheus metrics of `eagle-jax serve`, under vLLM's names (`GET /metrics`).

Each server has its own registry (several servers can share a process, as in
the tests and `eagle-jax bench --suite serve`). Every metric has vLLM's
`model_name` label. Counters get Prometheus' `_total` suffix.

    vllm:num_requests_running / vllm:num_requests_waiting     gauges, read from the engine at scrape
    vllm:time_to_first_token_seconds                          histogram, arrival to first token
    vllm:inter_token_latency_seconds                          histogram, gap between streamed engine steps
    vllm:request_time_per_output_token_seconds                histogram, (end - first token) / (tokens - 1)
    vllm:e2e_request_latency_seconds                          histogram, arrival to end
    vllm:prompt_tokens / vllm:generation_tokens               counters
    vllm:request_success{finished_reason}                     counter: stop, length, abort
    vllm:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens    counters
    vllm:spec_decode_num_accepted_tokens_per_pos{position}    counter
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from eagle_jax.serve.protocol import FINISH_REASONS

__all__ = ["Metrics", "CONTENT_TYPE_LATEST"]

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0, 160.0, 640.0)
_L = ["model_name"]


class Metrics:
    def __init__(self, model_name: str, load):
        """`load()` returns the engine's (running, waiting) requests."""
        self.registry = r = CollectorRegistry()
        self.model = model_name
        running = Gauge("vllm:num_requests_running", "Requests on the engine now.", _L, registry=r)
        waiting = Gauge("vllm:num_requests_waiting", "Requests queued for the engine.", _L, registry=r)
        running.labels(model_name).set_function(lambda: load()[0])
        waiting.labels(model_name).set_function(lambda: load()[1])
        hist = lambda name, doc: Histogram(name, doc, _L, buckets=_LATENCY, registry=r)  # noqa: E731
        self.ttft = hist("vllm:time_to_first_token_seconds", "Arrival to the first token.")
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between streamed engine steps.")
        self.tpot = hist("vllm:request_time_per_output_token_seconds", "Decode time per output token.")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to the end of the request.")
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", _L, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", _L, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests.", _L + ["finished_reason"], registry=r)
        self.verify_steps = Counter("vllm:spec_decode_num_drafts", "Verify steps.", _L, registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Tokens drafted.", _L, registry=r)
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", _L, registry=r)
        self.per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                               "Draft tokens accepted at each position.", _L + ["position"], registry=r)

    def gap(self, seconds: float) -> None:
        """One streamed engine step after the first."""
        self.itl.labels(self.model).observe(seconds)

    def done(self, d) -> None:
        """A finished request (an engine Done)."""
        m = self.model
        self.success.labels(m, FINISH_REASONS[d.finish_reason]).inc()
        self.e2e.labels(m).observe(d.wall_s)
        self.prompt_tokens.labels(m).inc(d.prompt_tokens)
        self.generation_tokens.labels(m).inc(d.completion_tokens)
        if d.ttft_s is not None:
            self.ttft.labels(m).observe(d.ttft_s)
            if d.completion_tokens > 1:
                self.tpot.labels(m).observe((d.wall_s - d.ttft_s) / (d.completion_tokens - 1))
        if d.spec is not None:
            self.verify_steps.labels(m).inc(d.spec.verify_steps)
            self.draft_tokens.labels(m).inc(d.spec.draft_tokens)
            self.accepted.labels(m).inc(d.spec.accepted)
            for i, n in enumerate(d.spec.per_position):
                self.per_pos.labels(m, str(i)).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
