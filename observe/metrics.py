"""The observer's Prometheus series (written to PROMETHEUS_MULTIPROC_DIR like extproc's: ingest's /metrics
serves them). Labels are bounded: `model` is a configured model, `worker` a worker extproc routed to (at most
MAX_WORKERS distinct values, then `other`), `code` an HTTP status, `cause` and `outcome` fixed sets, `alias` an
alias extproc resolved (at most MAX_ALIASES, then `other`)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

from observe.entry import CAUSES, OUTCOMES, Observation

MAX_WORKERS = 1024
MAX_ALIASES = 256

_TTFT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
_E2E = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

TTFT = Histogram("cortex_ttft_seconds", "time to first token of streamed requests: the first response chunk "
                 "minus the request's arrival at Envoy", ["model", "worker"], buckets=_TTFT)
ITL = Histogram("cortex_itl_seconds", "mean time between tokens after the first, per streamed request",
                ["model", "worker"], buckets=_ITL)
E2E = Histogram("cortex_e2e_seconds", "request arrival to the last byte sent to the client", ["model", "worker"],
                buckets=_E2E)
REQUESTS = Counter("cortex_requests", "finished requests by HTTP status (0: the client got none)",
                   ["model", "worker", "code"])
ERRORS = Counter("cortex_request_errors", "requests that ended badly, by cause", ["model", "worker", "cause"])
PROMPT = Counter("cortex_prompt_tokens", "prompt tokens the engines reported", ["model", "worker"])
COMPLETION = Counter("cortex_completion_tokens", "completion tokens the engines reported", ["model", "worker"])
CACHED = Counter("cortex_engine_cached_tokens", "prompt tokens the engines reported as cached", ["model", "worker"])
CLAIMED = Counter("cortex_observed_claimed_hit_tokens", "Cortex's claimed hit tokens of the requests whose usage "
                  "reported cached_tokens (compare with cortex_engine_cached_tokens)", ["model", "worker"])
CLAIM_CHECK = Counter("cortex_claim_check", "Cortex's claim against the engine's cached_tokens: over (claimed "
                      "more: an alarm), exact, under, unreported", ["model", "worker", "outcome"])
CLAIM_ERROR = Counter("cortex_claim_error_tokens", "|claim - engine's cached_tokens| summed, by direction",
                      ["model", "worker", "outcome"])
TENANT_CHARGED = Counter("cortex_tenant_charged_tokens", "tokens charged to tenants with token limits, settled "
                         "from the engines' usage (weighted by admission.charge)", ["tenant"])
# Per alias target (a canary watched against its stable version): only requests that named an alias, labelled by
# the alias and the model it drew, so `sum by (model)` over one alias compares the versions directly.
ALIAS_REQUESTS = Counter("cortex_alias_requests", "finished requests that named an alias, by the target model "
                         "drawn and HTTP status (0: the client got none)", ["alias", "model", "code"])
ALIAS_ERRORS = Counter("cortex_alias_request_errors", "requests that named an alias and ended badly, by target "
                       "model and cause", ["alias", "model", "cause"])
ALIAS_TTFT = Histogram("cortex_alias_ttft_seconds", "time to first token of streamed requests that named an alias, "
                       "by target model", ["alias", "model"], buckets=_TTFT)
ALIAS_E2E = Histogram("cortex_alias_e2e_seconds", "request arrival to the last byte, requests that named an alias, "
                      "by target model", ["alias", "model"], buckets=_E2E)
START_TIME = Gauge("cortex_observer_start_time_seconds", "unix time the observer process started (a new value: a "
                   "restart)", multiprocess_mode="max")
ENTRIES = Counter("cortex_observer_entries", "access-log entries read: ok, not_routed (no extproc decision), "
                  "health (a probe of /cortex/health, not counted as a request), malformed", ["outcome"])


def prime(models: Iterable[str], workers: Iterable[str], labels: Labels,
          alias_targets: Iterable[tuple[str, str]] = ()) -> None:
    """The alarm series exist at 0 from the start for the configured models and workers (and each alias's
    targets), so that the first over-claim or error is an increase Prometheus sees (a series born at 1 has no
    earlier sample to rise from)."""
    for alias, model in alias_targets:
        for cause in CAUSES[1:]:
            ALIAS_ERRORS.labels(labels.alias(alias), model, cause)
    workers = list(workers)
    for model in models:
        for worker in workers:
            w = labels.worker(worker)
            for outcome in OUTCOMES:
                CLAIM_CHECK.labels(model, w, outcome)
            for outcome in ("over", "under"):
                CLAIM_ERROR.labels(model, w, outcome)
            for cause in CAUSES[1:]:
                ERRORS.labels(model, w, cause)


class Labels:
    """Bounds the worker label: extproc names only targets it knows, but a fleet that churns through worker
    ids must not grow the series without end."""

    def __init__(self) -> None:
        self.workers: set[str] = set()
        self.aliases: set[str] = set()

    def alias(self, alias: str) -> str:
        if alias in self.aliases:
            return alias
        if len(self.aliases) >= MAX_ALIASES:
            return "other"
        self.aliases.add(alias)
        return alias

    def worker(self, worker: str) -> str:
        if worker in self.workers:
            return worker
        if len(self.workers) >= MAX_WORKERS:
            return "other"
        self.workers.add(worker)
        return worker


def record(o: Observation, labels: Labels) -> None:
    model, worker = o.model, labels.worker(o.worker)
    REQUESTS.labels(model, worker, str(o.status)).inc()
    if o.cause:
        ERRORS.labels(model, worker, o.cause).inc()
    if o.ttft_s is not None:
        TTFT.labels(model, worker).observe(o.ttft_s)
    if o.itl_s is not None:
        ITL.labels(model, worker).observe(o.itl_s)
    if o.e2e_s is not None:
        E2E.labels(model, worker).observe(o.e2e_s)
    if o.prompt_tokens is not None:
        PROMPT.labels(model, worker).inc(o.prompt_tokens)
    if o.completion_tokens is not None:
        COMPLETION.labels(model, worker).inc(o.completion_tokens)
    if o.cached_tokens is not None:
        CACHED.labels(model, worker).inc(o.cached_tokens)
    if o.alias:
        _record_alias(o, labels.alias(o.alias))
    outcome = o.outcome
    if outcome is not None:
        CLAIM_CHECK.labels(model, worker, outcome).inc()
        if outcome in ("over", "under") and o.claimed is not None and o.cached_tokens is not None:
            CLAIM_ERROR.labels(model, worker, outcome).inc(abs(o.claimed - o.cached_tokens))
        if o.cached_tokens is not None and o.claimed is not None:
            CLAIMED.labels(model, worker).inc(o.claimed)


def _record_alias(o: Observation, alias: str) -> None:
    ALIAS_REQUESTS.labels(alias, o.model, str(o.status)).inc()
    if o.cause:
        ALIAS_ERRORS.labels(alias, o.model, o.cause).inc()
    if o.ttft_s is not None:
        ALIAS_TTFT.labels(alias, o.model).observe(o.ttft_s)
    if o.e2e_s is not None:
        ALIAS_E2E.labels(alias, o.model).observe(o.e2e_s)
