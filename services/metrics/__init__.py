"""Metrics service: one Prometheus endpoint for every process of the run."""
