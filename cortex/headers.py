"""HTTP header names Cortex sets or reads, written once (Envoy's config, extproc's mutations, tests and tools).

Request side (set by extproc for Envoy's route; a client's own copies are removed at the door):
  POOL              the Envoy cluster (model pool) the request goes to
  ENDPOINTS         the ordered endpoint list Envoy's override_host policy walks (first attempt, then retries)
  PD_ROUTE          on a PD pair's decode leg: the route that never retries once the request reached a worker
  DP_RANK           vLLM's selector of the engine inside a data-parallel deployment
Response side (set by extproc on the answer the client gets):
  ASSIGNED_WORKER   the worker that served (prefill=<id>,decode=<id> for a pair)
  CACHE_HIT_TOKENS  prompt tokens Cortex proves were cached on it (0 unless proven)
  MATCH_MODE        the step of the fallback chain that decided (extproc/policies)
  ROUTE_REASON      why, as a reason code
  PD                a PD model's outcome: pair, pair:repicked, skipped:<why>, fallback:<why>
  DROPPED_REASON    why Cortex or its Envoy answered in place of a worker (every refusal; docs/observability.md),
                    also under llm-d's name LLMD_DROPPED_REASON
"""

from __future__ import annotations

POOL = "x-cortex-pool"
ENDPOINTS = "x-gateway-destination-endpoint"
PD_ROUTE = "x-cortex-pd-route"
DP_RANK = "x-data-parallel-rank"
WORKER = "x-cortex-worker"
"""Not set by Cortex today; reserved so a client cannot pretend to have picked a worker."""

ASSIGNED_WORKER = "x-cortex-assigned-worker"
CACHE_HIT_TOKENS = "x-cortex-cache-hit-tokens"
MATCH_MODE = "x-cortex-match-mode"
ROUTE_REASON = "x-cortex-route-reason"
PD = "x-cortex-pd"
DROPPED_REASON = "x-cortex-dropped-reason"
"""Why Cortex or its Envoy answered in place of a worker (invalid_request, no_worker, queue_full, ...)."""
LLMD_DROPPED_REASON = "x-llm-d-request-dropped-reason"
"""The same reason under llm-d's name, for clients written against it."""

CALL_METHOD = "x-cortex-method"
CALL_PATH = "x-cortex-path"
CALL_AUTHORITY = "x-cortex-authority"
"""`extproc.transport: http`: the request's pseudo-headers, as the Lua caller hands them to extproc (its own call has
its own)."""
SERVED = "x-cortex-served"
SERVED_WORKER = "x-cortex-served-worker"
"""`extproc.transport: http`: the address and the id (its endpoint's metadata) of the worker that answered, put on
the response by the route for the Lua caller, which removes them."""

RESERVED_REQUEST = (POOL, ENDPOINTS, WORKER, MATCH_MODE, CACHE_HIT_TOKENS, ASSIGNED_WORKER, ROUTE_REASON, DP_RANK,
                    PD_ROUTE, PD, CALL_METHOD, CALL_PATH, CALL_AUTHORITY)
"""Headers only Cortex may set on the request path. DP_RANK pins a vLLM DP rank: Cortex's cache claims assume
the rank it chose. A client's CALL_PATH would make extproc judge another path than Envoy routes."""
