"""The paths Cortex itself answers on the public listener (extproc, before any worker), beside the OpenAI API."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

EXPLAIN_PATH = "/cortex/v1/route"
"""POST: the routing decision as JSON, nothing forwarded: on ingest's admin port (extproc.route_explain), and on the
public listener only with extproc.public_route_explain."""
def explain_socket(runtime: Path) -> Path:
    """Where extproc process 0 answers route explain for ingest's admin port: a Unix socket in runtime_dir, or, when
    that path is too long for a socket (108 bytes on Linux), in a private directory named after it under /tmp."""
    path = runtime / "explain.sock"
    if len(str(path).encode()) < 100:
        return path
    digest = hashlib.sha256(str(runtime).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"cortex-{os.getuid()}-{digest}" / "explain.sock"
TENANT_VIEW_HEADER = "x-cortex-tenant"
"""On the admin port's route explain: decide as this tenant would be routed (its cache salt)."""
MODELS_PATH = "/v1/models"
HEALTH_PATH = "/cortex/health"
DECIDE_PATH = "/cortex/decide"
END_PATH = "/cortex/decide/end"
"""`extproc.transport: http`: where Envoy's Lua caller posts each request to an extproc process (never public)."""
"""GET: 200 when the whole chain Envoy -> extproc answers (load balancers probe it; not a request to observe)."""

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
"""Anthropic's token counting (vLLM 0.32 serves it; Claude Code probes it): a Messages body without max_tokens,
answered `{"input_tokens": N}`. In the default listen.paths beside /v1/messages, governed like every inference
path, routed by load among its model's workers with no claim: it computes no KV (extproc/agent_apis.py)."""
GENERATE = "/generate"
EMBEDDINGS = "/v1/embeddings"
RERANK = "/v1/rerank"
SCORE = "/v1/score"
STORED_RESPONSE = r"/v1/responses/[A-Za-z0-9_-]+(?:/cancel)?"
"""A stored response: `GET /v1/responses/{id}` (retrieve) and `POST /v1/responses/{id}/cancel` (vLLM's two; SGLang
serves the same), forwarded wherever /v1/responses is. Only the worker that answered holds it: extproc sends the
request there when Cortex named the id (extproc/response_ids.py), else to the least loaded worker."""
INFERENCE_PATHS = (CHAT, COMPLETIONS, RESPONSES, MESSAGES, COUNT_TOKENS, GENERATE, EMBEDDINGS, RERANK, SCORE)
"""The inference paths: every one goes through extproc's one pipeline (extproc/inference_paths.py)."""

TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize")
"""The engines' tokenizer endpoints (vLLM's unprefixed pair, SGLang's /v1 pair): no inference, but each answers
with its model's tokenizer, so extproc sends them only to a worker of the model the body names."""

PUBLIC_PATHS = (CHAT, COMPLETIONS, "/v1/models", EMBEDDINGS, RESPONSES, MESSAGES, COUNT_TOKENS, RERANK, SCORE,
                *TOKENIZER_PATHS, GENERATE, "/health")
"""The engines' paths the public listener forwards by default (`listen.paths`): their inference APIs. The rest of
what an engine serves is its admin plane (SGLang /flush_cache, /abort_request, /update_weights_*, profiling, vLLM
/reset_prefix_cache, /sleep, /collective_rpc, LoRA loading, /metrics): a client reaching it through the gateway
could wipe every tenant's cache or read fleet-wide counters, so it is not forwarded (404 from Envoy)."""
