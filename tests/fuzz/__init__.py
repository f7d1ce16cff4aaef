"""Property-based fuzzing of taskloop's hostile-input surfaces (issue 14, item 5), with Hypothesis.

* test_fuzz_definitions.py: define_task, define_loop_task, define_gate, define_workflow,
  define_graph_workflow and their options (pure: no Redis);
* test_fuzz_inputs.py: run inputs, run ids, workflow names and versions, reading calls on
  unknown runs (client side, a redis-server, no worker);
* test_fuzz_checks_gates.py: what a check returns (on a real worker) and gate decisions;
* test_fuzz_messages.py: raw messages published onto the broker with kombu (a real worker);
* test_fuzz_cli.py: ``taskloop`` arguments (click's CliRunner, and a few real subprocesses).

Each module that needs Redis starts its own ``redis-server`` on a free port (never the one on
6379), and, where a worker is needed, its own ``taskloop worker`` processes.

Two Hypothesis settings profiles, registered here as ``taskloop-fuzz-ci`` and
``taskloop-fuzz-long`` and chosen by ``TASKLOOP_FUZZ_PROFILE`` (each property takes its settings
from ``fuzz(ci=N, long=M)``, so loading them changes nothing for the other tests):

* ``ci`` (the default, what ``python -m pytest`` and .ci/run run): tens to hundreds of examples
  per property, ``derandomize=True`` (the same examples on every run: CI is reproducible), no
  example database, no deadline, no shrinking of the properties that drive live processes. The
  whole directory runs in about 30 s (measured on 2 cores; the budget is well under 2 minutes).
* ``long``: thousands of examples for the pure and client-side properties and hundreds for
  those that drive a worker, random seeds, and Hypothesis's example database (``.hypothesis/``,
  so that a failure found once is replayed first the next time). No per-test timeout. About
  12 minutes on 2 cores. Run it with::

      TASKLOOP_FUZZ_PROFILE=long python -m pytest tests/fuzz

  Add ``--hypothesis-seed=N`` to replay one seed, ``--hypothesis-show-statistics`` to see what
  each property explored, and ``-k definitions`` (or ``inputs``, ``checks``, ``gates``,
  ``messages``, ``cli``) to fuzz one surface. ``TASKLOOP_FUZZ_EXAMPLES=N`` sets every property's
  example count, in either profile.

A failure prints the falsifying example and a ``@reproduce_failure`` blob that replays it.
"""

from __future__ import annotations

import os
import warnings

from hypothesis import HealthCheck, Phase, settings

# On a failure, Hypothesis's pytest plugin imports its patch writer, which imports libcst, which
# builds a mypy_extensions.TypedDict: a DeprecationWarning, which pyproject's `filterwarnings =
# error` turns into an INTERNALERROR that hides the failing example. Import it once, quietly, now.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
        import hypothesis.extra._patching  # noqa: F401
    except ImportError:  # libcst is optional
        pass

PROFILE = os.environ.get("TASKLOOP_FUZZ_PROFILE", "ci").strip().lower() or "ci"
if PROFILE not in ("ci", "long"):
    raise RuntimeError(f"TASKLOOP_FUZZ_PROFILE must be 'ci' or 'long', got {PROFILE!r}")
LONG = PROFILE == "long"

_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
             HealthCheck.function_scoped_fixture, HealthCheck.differing_executors]

settings.register_profile(
    "taskloop-fuzz-ci", deadline=None, derandomize=True, database=None, print_blob=True,
    suppress_health_check=_SUPPRESS, max_examples=50,
)
settings.register_profile(
    "taskloop-fuzz-long", deadline=None, print_blob=True, suppress_health_check=_SUPPRESS, max_examples=2000,
)
BASE = settings.get_profile(f"taskloop-fuzz-{PROFILE}")
_OVERRIDE = os.environ.get("TASKLOOP_FUZZ_EXAMPLES")

# pytest-timeout for the fuzz tests: the default 120 s per test in CI, none in the long profile
TIMEOUT = 0 if LONG else 120


def fuzz(ci: int, long: int, live: bool = False) -> settings:
    """Hypothesis settings of one property: ``ci`` examples in CI, ``long`` in the long profile.

    ``live``: the property drives real processes (a worker, a subprocess). In CI it is then not
    shrunk: a failure is reported as found (replayable from the printed blob) instead of spending
    minutes shrinking against live processes."""
    examples = int(_OVERRIDE) if _OVERRIDE else (long if LONG else ci)
    if live and not LONG:
        return settings(BASE, max_examples=examples, phases=[Phase.explicit, Phase.generate])
    return settings(BASE, max_examples=examples)
