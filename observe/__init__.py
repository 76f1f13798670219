"""`cortex observe`: every finished request, from Envoy's gRPC access log, as metrics, a request log line and
the status page's recent decisions (docs/observability.md)."""
