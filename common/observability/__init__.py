"""Logs, metrics and traces shared by the services: JSON log lines, metric naming and the catalogue of families, OpenTelemetry."""
