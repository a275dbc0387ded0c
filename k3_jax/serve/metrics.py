"""The server's Prometheus metrics (GET /metrics): latency histograms the engine client
observes (time to first token, between tokens, arrival to last token), gauges of the
engine's queue, slots and pages, and counters of its prefix cache, tokens, preemptions,
requests, (multi-host) relay and speculation."""

from __future__ import annotations


def make_metrics(engine):
  from prometheus_client import CollectorRegistry, Gauge, Histogram
  from prometheus_client.core import CounterMetricFamily

  reg = CollectorRegistry()
  buckets = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60)
  m = {
      "ttft": Histogram("k3_time_to_first_token_seconds", "time to first token", registry=reg,
                        buckets=buckets),
      "itl": Histogram("k3_inter_token_latency_seconds", "time between streamed tokens",
                       registry=reg, buckets=buckets),
      "e2e": Histogram("k3_request_latency_seconds", "arrival to last token", registry=reg,
                       buckets=buckets),
  }
  Gauge("k3_num_requests_running", "requests holding a slot", registry=reg).set_function(
      lambda: len(engine.running))
  Gauge("k3_num_requests_waiting", "requests queued for a slot", registry=reg).set_function(
      lambda: len(engine.waiting))

  class EngineCounters:
    def collect(self):
      stats = engine.prefix.stats() if engine.prefix is not None else {}
      for name, doc, value in (
          ("k3_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
           stats.get("queries", 0)),
          ("k3_prefix_cache_hits", "prompt tokens served from the prefix cache",
           stats.get("hits", 0)),
          ("k3_prefix_cache_evictions", "prefix cache entries evicted",
           stats.get("evictions", 0)),
          ("k3_generation_tokens", "generated tokens", engine.generated_tokens),
          ("k3_preemptions", "requests preempted when the KV cache ran out (recomputed later)",
           engine.kv.preemptions),
          ("k3_request_success", "finished requests", engine.finished_requests),
          ("k3_request_failure", "requests that failed (an error or a timeout)",
           engine.failed_requests),
          *(() if engine.relay is None else (      # multi-host: the plans sent (relay.py)
              ("k3_relay_plans", "step plans published to the other processes",
               engine.relay.seq),
              ("k3_relay_plan_bytes", "bytes of the published plans", engine.relay.sent_bytes),
              ("k3_relay_send_seconds", "seconds spent publishing plans",
               engine.relay.send_seconds))),
          *(() if getattr(engine, "speculator", None) is None else (   # speculation
              ("k3_spec_verify_steps", "speculative verify steps", engine.speculator.steps),
              ("k3_spec_verify_rows", "requests verified, summed over the verify steps",
               engine.speculator.rows),
              ("k3_spec_draft_tokens", "draft tokens verified", engine.speculator.drafted),
              ("k3_spec_accepted_tokens", "draft tokens accepted",
               engine.speculator.accepted)))):
        c = CounterMetricFamily(name, doc)
        c.add_metric([], value)
        yield c

  for key, doc in (("free_slots", "sequence slots free"),
                   ("used_pages", "KV pages in use (requests and the prefix cache)"),
                   ("free_pages", "KV pages free"),
                   ("cached_pages", "KV pages held by the prefix cache"),
                   ("pinned_blocks", "prefix-cache blocks pinned by running requests"),
                   ("pinned_checkpoints", "prefix-cache KDA checkpoint pins")):
    Gauge(f"k3_{key}", doc, registry=reg).set_function(
        lambda key=key: engine.resource_counts()[key])
  reg.register(EngineCounters())
  if getattr(engine, "tiers", None) is not None:      # cache tiers: per-tier counters
    from k3_jax.serve.cache_tiers import TierMetrics
    reg.register(TierMetrics(engine))
  return reg, m


__all__ = ["make_metrics"]
