"""Whether this process traces (SPEC §14), decided without importing OpenTelemetry: tracing is on
when ``taskloop[otel]`` is installed and either the standard variables say where traces go
(``OTEL_TRACES_EXPORTER`` other than ``none``, ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), or the application set its own SDK ``TracerProvider``
before its first run. ``OTEL_SDK_DISABLED=true`` turns it off. Off, no opentelemetry module is
imported and no span is made; on, ``hook()`` is the ``TracingHook`` (ops/otel.py) that
runtime/instruments.py registers."""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from taskloop.ops.hooks import Hook

log = logging.getLogger("taskloop.ops.tracing")

ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def wanted() -> bool:
    """What the environment and the application ask (no import of opentelemetry)."""
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER")
    if exporter is not None and exporter.strip():
        return exporter.strip().lower() != "none"
    if any(env.get(name, "").strip() for name in ENDPOINT_ENVS):
        return True
    return "opentelemetry.trace" in sys.modules and app_provider_set()


def app_provider_set() -> bool:
    """Whether the application set a TracerProvider (opentelemetry is imported already)."""
    from opentelemetry import trace

    return not isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def hook() -> Hook | None:
    """The tracing hook of this process, or None when tracing is off (or not installed: said once)."""
    if not wanted():
        return None
    try:
        from taskloop.ops import otel
    except ImportError as exc:
        log.warning("tracing is asked for (OTEL_* variables) but OpenTelemetry is not installed (%s): "
                    "pip install 'taskloop[otel]'; tracing stays off", exc)
        return None
    return otel.tracing_hook()
