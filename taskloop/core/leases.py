"""A phase's time rules (pure): when a round runs out, and how long the lease of a queued or a
running phase lasts before the reconciler takes it back.

``round_deadline`` and ``lease_until`` are evaluated by begin.lua too, under the same names. A
queued phase's lease is ``queued_lease_until``; a phase queued again under a lease that is still
ahead keeps that one (``kept_lease``, the record's ``lease_kept``), and its own counts when the
kept one expires (``own_lease_if_kept``).
"""

from __future__ import annotations

from taskloop.core.records import TaskRecord
from taskloop.core.states import QUEUED_STATES


def round_deadline(began_at: float, timeout_ms: int) -> float:
    """The deadline rule: a round (or try) must end ``timeout_ms`` after it began; a check keeps its
    round's deadline. (begin.lua evaluates the same rule under the same name.)"""
    return began_at + timeout_ms / 1000.0


def lease_until(now: float, deadline: float | None, running_lease_s: float, grace_s: float) -> float:
    """The lease rule: a running phase is reclaimed ``running_lease_s`` after its last renewal,
    and never before its hard limit (deadline + grace) has passed by a second.
    (begin.lua evaluates the same rule under the same name.)"""
    until = now + running_lease_s
    if deadline is not None:
        until = max(until, deadline + grace_s + 1.0)
    return until


def queued_lease_until(record: TaskRecord, queued_lease_s: float) -> float | None:
    """The lease rule for a queued phase: its message is sent again ``queued_lease_s`` after it was
    queued, or after its retry is due (None: the record is not queued). The planner writes this
    lease when a phase enters its queue; a phase queued again under a lease that is still ahead
    keeps that earlier lease instead (``kept_lease``, the record's ``lease_kept``),
    and the reconciler, finding that one expired, moves it to this time instead of sending the
    message again."""
    if record.state not in QUEUED_STATES or record.queued_at is None:
        return None
    return max(record.queued_at, record.not_before or 0.0) + queued_lease_s


def own_lease_if_kept(record: TaskRecord, queued_lease_s: float) -> float | None:
    """When the lease in the run's lease set is one a queued phase kept from an earlier queueing
    (``lease_kept``), the phase's own queued lease, which is what counts (the reconciler moves the
    kept one there; a redelivery is judged by it); None when the stored lease is the phase's own."""
    return queued_lease_until(record, queued_lease_s) if record.lease_kept is not None else None


def kept_lease(stored: TaskRecord | None, new: TaskRecord | None, until: float | None, now: float,
               queued_lease_s: float) -> float | None:
    """The lease a phase queued again (the next phase of a loop, a retry) keeps from its earlier
    queueing instead of writing its own at ``until`` (None: it writes its own): the stored record's
    lease, while that is still ahead and no later than ``until`` (five of a 3-round loop's six
    lease writes). The new record says so (``lease_kept``): when that lease expires before the
    phase's own, the reconciler moves it to the phase's own (``queued_lease_until``) instead of
    sending the message again. A lease written for the phase's own queueing is taken at its word:
    when it expires, the message is presumed lost."""
    if until is None or stored is None or new is None or stored.state not in QUEUED_STATES \
            or new.state not in QUEUED_STATES:  # a running phase's lease was written for it (begin.lua)
        return None
    held = stored.lease_kept if stored.lease_kept is not None else queued_lease_until(stored, queued_lease_s)
    return held if held is not None and now < held <= until else None
