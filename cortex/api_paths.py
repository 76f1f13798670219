"""The paths Cortex itself answers on the public listener (extproc, before any worker), beside the OpenAI API."""

from __future__ import annotations

EXPLAIN_PATH = "/cortex/v1/route"
"""POST: the routing decision as JSON, nothing forwarded (extproc.route_explain)."""
MODELS_PATH = "/v1/models"
HEALTH_PATH = "/cortex/health"
"""GET: 200 when the whole chain Envoy -> extproc answers (load balancers probe it; not a request to observe)."""

PUBLIC_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/embeddings", "/v1/responses",
                "/v1/rerank", "/v1/score", "/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize",
                "/generate", "/health")
"""The engines' paths the public listener forwards by default (`listen.paths`): their inference APIs. The rest of
what an engine serves is its admin plane (SGLang /flush_cache, /abort_request, /update_weights_*, profiling, vLLM
/reset_prefix_cache, /sleep, /collective_rpc, LoRA loading, /metrics): a client reaching it through the gateway
could wipe every tenant's cache or read fleet-wide counters, so it is not forwarded (404 from Envoy)."""
