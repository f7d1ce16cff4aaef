"""Whether a process traces (taskloop/ops/tracing.py, runtime/instruments.py), each case in a fresh
Python: off without OTEL_* variables or an application's TracerProvider (taskloop.ops.otel is not
even imported), on with them, off again with OTEL_TRACES_EXPORTER=none or OTEL_SDK_DISABLED=true,
and a clear warning, tracing off, when the variables ask for it but taskloop[otel] is missing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("opentelemetry.sdk", reason="tracing needs taskloop[otel]")

REPORT = ("import sys; from taskloop.runtime import instruments; "
          "print(' '.join(type(h).__name__ for h in instruments.hooks().hooks), "
          "'taskloop.ops.otel' in sys.modules)")


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "TASKLOOP_METRICS"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                          env={**clean, **env})


def test_without_variables_or_a_provider_tracing_is_off_and_not_imported() -> None:
    assert _run(REPORT).stdout.split() == ["ObserverHook", "False"]


@pytest.mark.parametrize("env", [{"OTEL_TRACES_EXPORTER": "console"},
                                 {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"},
                                 {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}],
                         ids=["exporter", "endpoint", "traces endpoint"])
def test_the_standard_variables_turn_it_on(env: dict[str, str]) -> None:
    assert _run(REPORT, **env).stdout.split() == ["TracingHook", "ObserverHook", "True"]


@pytest.mark.parametrize("env", [{"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"},
                                 {"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"}],
                         ids=["exporter none", "sdk disabled"])
def test_none_or_disabled_keep_it_off(env: dict[str, str]) -> None:
    assert _run(REPORT, **env).stdout.split() == ["ObserverHook", "False"]


def test_the_applications_own_provider_turns_it_on_also_when_set_after_the_first_run() -> None:
    code = ("import time; from taskloop.runtime import instruments; first = len(instruments.hooks().hooks); "
            "from opentelemetry import trace; from opentelemetry.sdk.trace import TracerProvider; "
            "provider = TracerProvider(); trace.set_tracer_provider(provider); time.sleep(1.05); "
            "found = instruments.hooks().hooks; "
            "print(first, ' '.join(type(h).__name__ for h in found), found[0].provider is provider)")
    assert _run(code).stdout.split() == ["1", "TracingHook", "ObserverHook", "True"]


def test_asked_for_without_the_extra_it_says_how_to_install_it_and_stays_off() -> None:
    code = "import sys; sys.modules['opentelemetry'] = None; " + REPORT  # as if taskloop[otel] were not installed
    found = _run(code, OTEL_TRACES_EXPORTER="otlp")
    assert found.stdout.split() == ["ObserverHook", "False"]
    assert "pip install 'taskloop[otel]'; tracing stays off" in found.stderr
