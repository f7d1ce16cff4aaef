"""A phase's live text, without Redis: the entries' codec and segments (core/streamed.py), a phase's
buffer and its cap (worker/execution/streaming.py), what a failed write leaves marked, the
settings' checks. The writes themselves are tested on a real Redis in
tests/integration/test_streaming.py."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest

from taskloop.base.config import Settings
from taskloop.core.streamed import Piece, Segments
from taskloop.worker.execution.streaming import Flusher, PhaseStream, cut_utf8, utf8_size


class Writer:
    """A writer that keeps what it was given, or fails while ``down``."""

    def __init__(self) -> None:
        self.pieces: list[Piece] = []
        self.touched: list[set[str]] = []
        self.down = False

    def write(self, pieces: Sequence[Piece], touched: Iterable[str] = ()) -> None:
        if self.down:
            raise ConnectionError("away")
        self.pieces += pieces
        self.touched.append(set(touched))


def stream(max_bytes: int = 1000) -> tuple[PhaseStream, Flusher, Writer]:
    writer = Writer()
    flusher = Flusher(writer, flush_s=3600, grace_s=3600)  # type: ignore[arg-type]  # flushed by the test
    return PhaseStream(lambda: flusher, "r1", "write", 2, "attempt", max_bytes), flusher, writer


def test_segments_number_the_executions_of_a_phase_in_the_order_met() -> None:
    segments = Segments()
    first = Piece("r1", "write", 1, "attempt", "aaa", "one").fields()
    replay = Piece("r1", "write", 1, "attempt", "bbb", "two", dropped=3, capped=True).fields()
    check = Piece("r1", "write", 1, "check", "ccc", "three").fields()
    as_read = [{name: str(value) for name, value in fields.items()} for fields in (first, replay, first, check)]
    chunks = [segments.chunk(f"1-{n}", fields) for n, fields in enumerate(as_read)]
    assert [(c.segment, c.replay) for c in chunks if c] == [(1, False), (2, True), (1, False), (1, False)]
    assert chunks[1] is not None and (chunks[1].dropped, chunks[1].capped, chunks[1].id) == (3, True, "1-1")
    assert segments.chunk("1-9", {"x": "not ours"}) is None


def test_text_is_buffered_and_written_in_one_piece_per_flush() -> None:
    phase, flusher, writer = stream()
    for token in ("a", "b", "c"):
        phase(token)
    flusher.flush()
    assert [(p.text, p.round, p.phase, p.execution) for p in writer.pieces] == [("abc", 2, "attempt", phase.execution)]
    phase("d")
    assert phase.end() is not None
    flusher.flush()
    assert [p.text for p in writer.pieces] == ["abc", "d"] and writer.touched[-1] == {"r1"}
    phase("late")  # after its end: dropped
    flusher.flush()
    assert [p.text for p in writer.pieces] == ["abc", "d"]


def test_the_cap_cuts_between_characters_and_is_marked_once() -> None:
    phase, flusher, writer = stream(max_bytes=5)
    phase("ab")
    phase("éé")  # 4 bytes: one fits
    phase("more")
    flusher.flush()
    assert [(p.text, p.capped) for p in writer.pieces] == [("abé", True)]
    phase("x")
    flusher.flush()
    assert len(writer.pieces) == 1


def test_a_failed_write_is_dropped_and_marked_in_the_next_piece() -> None:
    phase, flusher, writer = stream()
    writer.down = True
    phase("lost ")
    flusher.flush()
    writer.down = False
    phase("kept")
    flusher.flush()
    assert [(p.text, p.dropped) for p in writer.pieces] == [("kept", 5)]


def test_text_is_sized_in_utf8_and_lone_surrogates_are_replaced() -> None:
    assert utf8_size("é") == ("é", 2)
    assert utf8_size("a\ud800") == ("a?", 2)
    assert cut_utf8("aé€", 4) == "aé"


@pytest.mark.parametrize(("name", "value", "message"), [
    ("TASKLOOP_STREAM_MAX_BYTES", "0", "TASKLOOP_STREAM_MAX_BYTES must be a positive number of bytes"),
    ("TASKLOOP_STREAM_GRACE_S", "-1", "TASKLOOP_STREAM_GRACE_S must be a positive number of seconds"),
    ("TASKLOOP_STREAM_FLUSH_S", "soon", "TASKLOOP_STREAM_FLUSH_S must be a number"),
])
def test_stream_settings_are_checked(monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        Settings(redis_url="redis://unused")
