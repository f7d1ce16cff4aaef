"""Runtime settings, read from the environment once per process (see docs/operations.md)."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any

from taskloop.base import limits

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None


def celery_config_module() -> Any | None:
    """The user's Celery settings module (TASKLOOP_CELERY_CONFIG, default ``celeryconfig``), if importable."""
    name = os.environ.get("TASKLOOP_CELERY_CONFIG", "celeryconfig")
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        return None


def _redis_url() -> str:
    env = os.environ.get("TASKLOOP_REDIS_URL")
    if env:
        return env
    module = celery_config_module()
    return getattr(module, "taskloop_redis_url", None) or DEFAULT_REDIS_URL


@dataclass(frozen=True)
class Settings:
    """Precedence for URLs: arguments > TASKLOOP_* environment > celeryconfig.py > defaults.

    The store uses ``redis_url``; the broker defaults to it (TASKLOOP_BROKER_URL, then
    TASKLOOP_REDIS_URL, then celeryconfig's ``broker_url``, then ``redis_url``)."""

    redis_url: str = field(default_factory=_redis_url)
    broker_url: str = ""
    imports: tuple[str, ...] = field(
        default_factory=lambda: tuple(
            m.strip() for m in os.environ.get("TASKLOOP_IMPORTS", "").split(",") if m.strip()
        )
    )
    # How long finished runs are kept (seconds).
    retention_s: int = field(default_factory=lambda: _int("TASKLOOP_RETENTION_S", 7 * 24 * 3600))
    # delete_on_success: a done run's records are dropped this long after it ends, so that a
    # client blocked in wait() can still read the result.
    success_grace_s: int = field(default_factory=lambda: _int("TASKLOOP_SUCCESS_GRACE_S", 60))
    # Lease of a phase whose message is queued: after this the reconciler sends it again.
    queued_lease_s: float = field(default_factory=lambda: _float("TASKLOOP_QUEUED_LEASE_S", 300.0))
    # Lease of a running phase, renewed while the callback runs; a dead worker's phase is
    # replayed once its lease has expired.
    running_lease_s: float = field(default_factory=lambda: _float("TASKLOOP_LEASE_S", 30.0))
    # The pool a worker runs phases on (taskloop worker -P; taskloop/worker/pools/__init__.py):
    # prefork, threads, gevent, asyncio or solo; empty: the Celery configuration's, else prefork.
    pool: str = field(default_factory=lambda: os.environ.get("TASKLOOP_POOL", "").strip())
    # The asyncio pool (taskloop worker -P asyncio): threads that run sync callbacks and the tasks
    # that are not phases (taskloop/worker/pools/asyncio_pool.py).
    sync_threads: int = field(default_factory=lambda: _int("TASKLOOP_SYNC_THREADS", 100))
    # How often a worker polls for cancellation of the phases it runs.
    watch_interval_s: float = field(default_factory=lambda: _float("TASKLOOP_WATCH_INTERVAL_S", 0.2))
    # A phase executed this many times without recording an outcome is failed.
    max_executions: int = field(default_factory=lambda: _int("TASKLOOP_MAX_EXECUTIONS", 5))
    # Hard limit = deadline + grace: how long a callback that ignores a timeout may overrun.
    timeout_grace_s: float = field(default_factory=lambda: _float("TASKLOOP_TIMEOUT_GRACE_S", 2.0))
    # How often the reconciler runs (beat schedule, and the thread in every worker); 0 = never.
    reconcile_interval_s: float = field(default_factory=lambda: _float("TASKLOOP_RECONCILE_INTERVAL_S", 5.0))
    # Events kept per run (XADD MAXLEN ~): older ones are trimmed.
    events_maxlen: int = field(default_factory=lambda: _int("TASKLOOP_EVENTS_MAXLEN", 100_000))
    # How long RunHandle.wait() rides out a Redis outage before it fails with StoreUnavailable.
    wait_outage_s: float = field(default_factory=lambda: _float("TASKLOOP_WAIT_OUTAGE_S", 30.0))
    # How long a worker keeps trying to record the outcome of a phase while Redis is unreachable
    # (the outcome is written once Redis is back; past this, the phase's lease replays it).
    record_outage_s: float = field(default_factory=lambda: _float("TASKLOOP_RECORD_OUTAGE_S", 120.0))
    # How long a callback may ignore a cancel or stop signal before its process is stopped.
    cancel_grace_s: float = field(default_factory=lambda: _float("TASKLOOP_CANCEL_GRACE_S", 30.0))
    # Warm shutdown (SIGTERM): how long running phases may finish before they are handed back to
    # the queue for another worker (taskloop/worker/liveness/shutdown.py).
    shutdown_grace_s: float = field(default_factory=lambda: _float("TASKLOOP_SHUTDOWN_GRACE_S", 20.0))
    # TLS (rediss://): the CA that signed Redis's certificate (else the system's trust store), and
    # an optional client certificate and key; the URL's ssl_ca_certs/ssl_certfile/ssl_keyfile win.
    tls_ca: str = field(default_factory=lambda: os.environ.get("TASKLOOP_TLS_CA", ""))
    tls_cert: str = field(default_factory=lambda: os.environ.get("TASKLOOP_TLS_CERT", ""))
    tls_key: str = field(default_factory=lambda: os.environ.get("TASKLOOP_TLS_KEY", ""))
    # Turn TLS certificate verification off (tests only; logged as a warning for every client).
    tls_insecure: bool = field(default_factory=lambda: os.environ.get("TASKLOOP_TLS_INSECURE", "").strip().lower()
                               in ("1", "true", "yes", "on"))
    # The Sentinel master name when a sentinel:// URL has no ?master=.
    sentinel_master: str = field(default_factory=lambda: os.environ.get("TASKLOOP_SENTINEL_MASTER", ""))
    # Payload caps, in bytes of UTF-8 JSON (taskloop/base/limits.py): past one, the client raises
    # InvalidInput and a phase fails with OutputTooLarge; the value is never written to Redis.
    max_input_bytes: int = field(default_factory=lambda: _int(limits.INPUT_ENV, limits.DEFAULT_BYTES))
    max_output_bytes: int = field(default_factory=lambda: _int(limits.OUTPUT_ENV, limits.DEFAULT_BYTES))
    max_feedback_bytes: int = field(default_factory=lambda: _int(limits.FEEDBACK_ENV, limits.DEFAULT_BYTES))
    max_gate_value_bytes: int = field(default_factory=lambda: _int(limits.GATE_VALUE_ENV, limits.DEFAULT_BYTES))
    max_receipt_bytes: int = field(default_factory=lambda: _int(limits.RECEIPT_ENV, limits.DEFAULT_RECEIPT_BYTES))
    # How long a cache entry lives when its Cache has no max_age_ms (seconds; default 30 days).
    cache_ttl_s: int = field(default_factory=lambda: _int("TASKLOOP_CACHE_TTL_S", limits.DEFAULT_CACHE_TTL_S))
    # ctx.stream (SPEC §13; taskloop/worker/execution/streaming.py): at most this many bytes (UTF-8) of a
    # phase's live text are streamed (past it the rest is dropped and the drop marked); a run's live text
    # is kept this long after its last write (the end of its last streaming phase); a process writes
    # what its phases streamed at most once per flush interval, in one call.
    stream_max_bytes: int = field(default_factory=lambda: _int(limits.STREAM_ENV, limits.DEFAULT_BYTES))
    stream_grace_s: float = field(default_factory=lambda: _float("TASKLOOP_STREAM_GRACE_S", 600.0))
    stream_flush_s: float = field(default_factory=lambda: _float("TASKLOOP_STREAM_FLUSH_S", 0.2))
    # An action asked of a worker by run id (decide, resume, fork without the workflow's code:
    # taskloop/runtime/acting.py): how long the caller waits for the worker's verdict.
    act_timeout_s: float = field(default_factory=lambda: _float("TASKLOOP_ACT_TIMEOUT_S", 15.0))

    def __post_init__(self) -> None:
        for name, setting in ((limits.INPUT_ENV, "max_input_bytes"), (limits.OUTPUT_ENV, "max_output_bytes"),
                              (limits.FEEDBACK_ENV, "max_feedback_bytes"),
                              (limits.GATE_VALUE_ENV, "max_gate_value_bytes"),
                              (limits.RECEIPT_ENV, "max_receipt_bytes")):
            limits.check_positive(name, getattr(self, setting), "number of bytes")
        limits.check_positive("TASKLOOP_CACHE_TTL_S", self.cache_ttl_s, "number of seconds")
        limits.check_positive(limits.STREAM_ENV, self.stream_max_bytes, "number of bytes")
        for name, seconds in (("TASKLOOP_STREAM_GRACE_S", self.stream_grace_s),
                              ("TASKLOOP_STREAM_FLUSH_S", self.stream_flush_s),
                              ("TASKLOOP_ACT_TIMEOUT_S", self.act_timeout_s)):
            if not 0 < seconds < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {seconds!r}")
        if not self.broker_url:
            broker = os.environ.get("TASKLOOP_BROKER_URL") or os.environ.get("TASKLOOP_REDIS_URL")
            if not broker:
                broker = getattr(celery_config_module(), "broker_url", None) or self.redis_url
            object.__setattr__(self, "broker_url", broker)

    def caps(self) -> limits.Caps:
        """The payload caps of these settings."""
        return limits.Caps(input=self.max_input_bytes, output=self.max_output_bytes,
                           feedback=self.max_feedback_bytes, gate_value=self.max_gate_value_bytes,
                           receipt=self.max_receipt_bytes)


_settings: Settings | None = None


def settings() -> Settings:
    global _settings
    if _settings is None:
        _settings = Settings()
    return _settings


def reset() -> None:
    """Forget the cached settings (tests, or after changing the environment)."""
    global _settings
    _settings = None


def min_lease_s(config: Settings) -> float:
    """No lease is ever written closer to its expiry than this: the reconciler need not look at a
    live run sooner (see taskloop/worker/recovery/reconciler.py)."""
    return min(config.running_lease_s, config.queued_lease_s)
