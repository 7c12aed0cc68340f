"""Device telemetry: gauges of the card (NPU, GPU) or host a service runs on, for /metrics."""
