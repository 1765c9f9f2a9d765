"""Prometheus metrics, the /metrics and /healthz server, and the JSONL event log."""
