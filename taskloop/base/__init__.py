"""The base layer: what every other layer may use and that uses nothing of taskloop's own above it
(errors, settings, JSON values, payload limits, the clock, text for terminals, logs and pages)."""
