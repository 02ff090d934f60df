"""Observability (README, "Observability"): OpenTelemetry traces (tracing.py), Prometheus
metrics (metrics.py) and trace ids in structlog lines (logs.py), wired through the facade in
telemetry.py."""
