"""What a loop's round recorded of its check, and which feedback an attempt gets (pure).

A check's verdict is stored in ``c:<key>:<round>`` (``fields.check_field``) as a JSON object:
``done``, ``feedback`` (a string, or null) and, only when the check gave one, ``score``.
``StoredCheck`` is that object: ``encode`` writes it (the worker, under the feedback cap),
``decode`` reads it back (the worker, recovery, the views). A stored check without ``feedback``
(an older form) reads as one with none; fields it does not know are left out.

A fork may give round k's attempt its feedback (``fb:<key>:<round>``, a JSON string) in place of
round k - 1's check's: ``attempt_feedback`` is that rule, ``feedback_fields`` the fields it reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from taskloop.base.limits import Stored, store_form
from taskloop.core import fields as fld
from taskloop.define.options import LoopCheck


@dataclass(frozen=True)
class StoredCheck:
    """A round's recorded check: accepted (``done``) or not, its feedback, its score if any."""

    done: bool
    feedback: str | None = None
    score: float | None = None

    @classmethod
    def of(cls, check: LoopCheck) -> StoredCheck:
        return cls(check.done, check.feedback, check.score)

    @property
    def rejected(self) -> bool:
        """A rejection with feedback: what lets the next round's attempt start."""
        return not self.done and self.feedback is not None

    def form(self) -> dict[str, Any]:
        """The JSON object recorded (and shown in a ``RoundView``): the score only when there is one."""
        found: dict[str, Any] = {"done": self.done, "feedback": self.feedback}
        if self.score is not None:
            found["score"] = self.score
        return found

    def encode(self, limit: int) -> Stored:
        """The stored form (compact JSON), or its size when it is over ``limit`` (the feedback cap)."""
        return store_form(self.form(), limit)

    @classmethod
    def decode(cls, raw: str) -> StoredCheck:
        """The check ``raw`` records. ValueError when it is not JSON (json's own error) or not a
        check: not an object, ``done`` not a bool, ``feedback`` not a string or null, ``score`` not
        a number."""
        found = json.loads(raw)
        if not isinstance(found, dict):
            raise ValueError(f"a stored check is a JSON object, got {type(found).__name__}")
        done, feedback, score = found.get("done"), found.get("feedback"), found.get("score")
        if type(done) is not bool:
            raise ValueError(f"a stored check's done is true or false, got {done!r}")
        if feedback is not None and not isinstance(feedback, str):
            raise ValueError(f"a stored check's feedback is a string or null, got {type(feedback).__name__}")
        if score is not None and type(score) not in (int, float):
            raise ValueError(f"a stored check's score is a number, got {type(score).__name__}")
        return cls(done, feedback, None if score is None else float(score))

    @classmethod
    def read(cls, raw: str | None) -> StoredCheck | None:
        """``decode``, or None when nothing is recorded or it is not a check."""
        try:
            return cls.decode(raw) if raw is not None else None
        except ValueError:
            return None


def encode_given(feedback: str) -> str:
    """The stored form of the feedback a fork gives a round (``fields.feedback_field``)."""
    return json.dumps(feedback, ensure_ascii=False)


def decode_given(raw: str) -> Any:
    """The feedback a fork gave a round, from its stored form."""
    return json.loads(raw)


def feedback_fields(key: str, round: int) -> list[str]:
    """The fields ``attempt_feedback`` reads, in its order: the feedback a fork gave the round, then
    round - 1's check."""
    return [fld.feedback_field(key, round), *([fld.check_field(key, round - 1)] if round > 1 else [])]


def attempt_feedback(key: str, round: int, get: Callable[[str], str | None]) -> Any:
    """The feedback round ``round``'s attempt is called with: the one a fork gave the round, else
    what round - 1's check said (None in round 1). ``get`` reads a field (None when absent); the
    check is read only when no fork gave feedback. A check that is not one raises ValueError."""
    given, *previous = feedback_fields(key, round)
    found = get(given)
    if found is not None:
        return decode_given(found)
    check = get(previous[0]) if previous else None
    return StoredCheck.decode(check).feedback if check else None
