"""The paths Cortex itself answers on the public listener (extproc, before any worker), beside the OpenAI API."""

from __future__ import annotations

EXPLAIN_PATH = "/cortex/v1/route"
"""POST: the routing decision as JSON, nothing forwarded (extproc.route_explain)."""
MODELS_PATH = "/v1/models"
HEALTH_PATH = "/cortex/health"
"""GET: 200 when the whole chain Envoy -> extproc answers (load balancers probe it; not a request to observe)."""
