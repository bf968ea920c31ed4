"""Routing telemetry: Prometheus metrics of per-request sparsity (``elastic:`` prefix)."""
