"""Finished runs, compacted: what a run holds in Redis once it is over.

A live run is a hash of records, data and counters, a stream of events, an end marker and a lease
set: about 7.4 KB for a 3-round loop (1.8 KB once compacted), most of it the stream's and the
hash's own structures. Once
the run has ended (the reconciler forgets it, within a pass of its end: worker/recovery/reconciler.py),
``compact`` rewrites it in one script call (store/lua/compact.lua):

- the hash keeps only the run's meta fields (``fields.COMPACT_KEEP``: status, workflow, times, ...)
  and the marker ``fields.F_COMPACT``: what the run lists, ``wait()`` and a repeated start read;
- every other field but the live-only ones (the counters of open, active and paused tasks, and
  each task's prepared begin and throttle note: all of them zero or absent once a run is over)
  and every stream entry go into one compact record (``tl:{R}:z``): compressed JSON;
- the stream, the end marker and the lease set are deleted, and the rest keeps the run's remaining
  retention (``wait()`` reads a run's status before it blocks on the end marker).

The store's reads of a run (``hmget``, ``all_fields``, ``scan_fields``, ``events``, the UI's
lists) look in the compact record when the hash has the marker, so ``inspect``, ``events``,
``result``, ``wait``, the UI and fork see a compacted run as they saw it before. A write must not
touch a compacted run: ``expand`` (store/lua/expand.lua) makes it live-shaped again first (resume).
"""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from taskloop.core import fields as fld
from taskloop.core.states import TERMINAL_RUN
from taskloop.store import keys as k
from taskloop.store.calls import wrap

FORMAT = b"1"  # the compact record's layout: "1" + base64 of zlib of JSON {"f": fields, "e": entries}
TERMINAL = frozenset(status.value for status in TERMINAL_RUN)
# Phrases that most compact records hold, for zlib to refer to (a preset dictionary: a small record
# compresses better with one); changing it changes FORMAT.
_ZDICT = (b'{"f":{"fmt":"2","t:":{"key":"","kind":"loop","limit":,"status":"done","phase":"complete",'
          b'"round":,"token":,"attempts":,"execs":1,"queued_at":,"began_at":,"error":null},"c:":{"done":false,'
          b'"feedback":"},"e":[["-0",{"e":"[{\\"t\\":\\"phase\\",\\"k\\":\\"\\",\\"r\\":1,\\"p\\":\\"attempt\\",'
          b'\\"at\\":\\"d\\":{\\"exec\\":{\\"worker\\":\\"\\",\\"began\\":\\"execs\\":1,\\"attempt\\":\\"wait\\":'
          b'\\"took\\":}}},{\\"t\\":\\"run.started\\",\\"check\\",\\"complete\\",\\"done\\":false,\\"feedback\\":'
          b'\\"workflow\\":\\"version\\":\\"run.finished\\",\\"status\\":\\"done\\",\\"termination\\":null}]"}]]}')


def encode(fields: dict[str, str], entries: Sequence[tuple[str, dict[str, str]]]) -> str:
    """A compact record: the fields and stream entries of a run."""
    raw = json.dumps({"f": fields, "e": [[entry_id, entry] for entry_id, entry in entries]},
                     separators=(",", ":"), ensure_ascii=False).encode()
    packer = zlib.compressobj(9, zdict=_ZDICT)
    return (FORMAT + base64.b64encode(packer.compress(raw) + packer.flush())).decode()


@dataclass(frozen=True)
class Whole:
    """A run as read whole: its hash's fields and its stream's entries (``read_whole``)."""

    fields: dict[str, str]
    entries: list[tuple[str, dict[str, str]]]


WHOLE_PAGE = 50  # runs read whole in one pipelined round trip (a run's stream may hold many entries)


@dataclass(frozen=True)
class Record:
    """A compact record, read back."""

    fields: dict[str, str]
    entries: list[tuple[str, dict[str, str]]]


def decode(text: str) -> Record:
    if not text.startswith(FORMAT.decode()):
        raise ValueError(f"not a compact record of layout {FORMAT.decode()}")
    unpacker = zlib.decompressobj(zdict=_ZDICT)
    data = json.loads(unpacker.decompress(base64.b64decode(text[len(FORMAT):])) + unpacker.flush())
    return Record(dict(data["f"]), [(entry_id, dict(entry)) for entry_id, entry in data["e"]])


def live_only(field: str) -> bool:
    return field in fld.LIVE_ONLY or field.startswith(fld.LIVE_ONLY_PREFIXES)


class Compacted:
    """The store's side of compaction (a mixin of RedisStore: ``client``, ``url``, ``_call``)."""

    client: Any
    url: str

    def _call(self, name: str, keys: Sequence[str], args: Sequence[str | int | float]) -> Any: ...

    @wrap
    def read_whole(self, run_ids: Sequence[str]) -> dict[str, Whole]:
        """Every field and stream entry of each run, in pipelined reads of ``WHOLE_PAGE`` runs (what
        ``compact`` rewrites; the reconciler reads the runs that ended so, and their meta from it)."""
        return self._read_whole(run_ids)

    def _read_whole(self, run_ids: Sequence[str]) -> dict[str, Whole]:
        found: dict[str, Whole] = {}
        for start in range(0, len(run_ids), WHOLE_PAGE):
            page = run_ids[start:start + WHOLE_PAGE]
            pipe = self.client.pipeline(transaction=False)
            for run_id in page:
                keys = k.RunKeys.of(run_id)
                pipe.hgetall(keys.run)
                pipe.xrange(keys.events, "-", "+")
            replies = pipe.execute()
            for run_id, fields, entries in zip(page, replies[::2], replies[1::2], strict=True):
                found[run_id] = Whole(dict(fields), list(entries))
        return found

    @wrap
    def compact(self, run_id: str, whole: Whole | None = None) -> bool:
        """Compact a finished run as read now, or as ``whole`` holds it (from ``read_whole``; the
        script writes nothing if the run changed since). False: not finished, already compacted,
        or it changed meanwhile."""
        keys = k.RunKeys.of(run_id)
        whole = whole or self._read_whole([run_id])[run_id]
        found, entries = whole.fields, whole.entries
        status = found.get(fld.F_STATUS)
        if status not in TERMINAL or fld.F_COMPACT in found:
            return False
        kept = {name: found[name] for name in fld.COMPACT_KEEP if name in found and name not in fld.LIVE_ONLY}
        moved = {name: value for name, value in found.items() if name not in kept and not live_only(name)}
        args: list[str | int | float] = [fld.F_STATUS, status, len(found), len(entries), encode(moved, entries),
                                         fld.F_COMPACT, *(item for pair in kept.items() for item in pair)]
        return bool(self._call("compact", keys.with_compact(), args))

    @wrap
    def expand(self, run_id: str) -> bool:
        """Make a compacted run live-shaped again, before a write (False: it was not compacted)."""
        keys = k.RunKeys.of(run_id)
        record = self.compact_record(run_id)
        if record is None:
            return False
        args: list[str | int | float] = [fld.F_COMPACT, len(record.fields),
                                         *(item for pair in record.fields.items() for item in pair)]
        for entry_id, entry in record.entries:
            args += [entry_id, len(entry), *(item for pair in entry.items() for item in pair)]
        return bool(self._call("expand", keys.with_compact(), args))

    def compact_record(self, run_id: str) -> Record | None:
        """The run's compact record (None: the run is not compacted)."""
        text = self.client.get(k.RunKeys.of(run_id).compact)
        return None if text is None else decode(text)

    def compact_records(self, run_ids: Sequence[str]) -> list[Record | None]:
        """The compact records of several runs, in one pipelined read (None: not compacted)."""
        if not run_ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for run_id in run_ids:
            pipe.get(k.RunKeys.of(run_id).compact)
        return [None if text is None else decode(text) for text in pipe.execute()]

    def compacted_fields(self, run_id: str) -> dict[str, str]:
        """Every field of a compacted run: the meta fields its hash kept, and the rest."""
        record = self.compact_record(run_id)
        if record is None:
            return {}
        kept = self.client.hgetall(k.RunKeys.of(run_id).run)
        kept.pop(fld.F_COMPACT, None)
        return {**record.fields, **kept}
