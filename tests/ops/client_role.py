"""The client role, as a producer service does it, in its own process (TASKLOOP_REDIS_URL = the
`client` ACL user): start runs by workflow name (this process imports no workflow until its last
step), wait, inspect, read events, find a run by id prefix, list runs (a run whose records are
gone is not shown; the reconciler, not the client, takes it off the run lists), read a compacted
run, cancel a running run, and, with the workflows imported, cancel a run paused at a gate.

    python -m tests.ops.client_role GONE_RUN_ID COMPACTED_RUN_ID

Prints one line per step ("ok <step>") and exits 0; on the first failure prints
"broken <step>: <error>" and exits 1.
"""

from __future__ import annotations

import sys
import time

import taskloop as tl

STEP_TIMEOUT_S = 10.0


def main(gone: str, compacted: str) -> int:
    client = tl.TaskLoop()
    step = "start"
    try:
        handle = client.start("essay", {"topic": "acl"})
        step = "wait"
        result = handle.wait(timeout=STEP_TIMEOUT_S)
        assert result.status == "done", result
        print("ok start and wait", flush=True)
        step = "wait with progress"  # what `taskloop start --wait` does: every event as it comes
        seen: list[tl.Event] = []
        watched = client.start("essay", {"topic": "progress"})
        assert client.wait(watched.run_id, timeout=STEP_TIMEOUT_S, on_event=seen.append).status == "done"
        assert any(e.type == "run.finished" for e in seen), [e.type for e in seen]
        print("ok wait with progress", flush=True)
        step = "inspect"
        view = client.inspect(handle.run_id)
        assert view.tasks["write"].rounds, view
        assert client.result(handle.run_id) is not None
        print("ok inspect", flush=True)
        step = "events"
        assert client.events(handle.run_id), "no events"
        print("ok events", flush=True)
        step = "find by prefix"
        assert client.find(handle.run_id[:12]) == handle.run_id
        print("ok find by prefix", flush=True)
        step = "runs"
        listed = [r.run_id for r in client.runs(limit=100)]
        assert handle.run_id in listed and gone not in listed, listed
        done = [r.run_id for r in client.runs(status="done", workflow="essay", limit=100)]  # a run list
        assert handle.run_id in done and gone not in done, done
        every = [r.run_id for r in client.runs(status="done", limit=100)]  # every workflow's lists, merged
        assert handle.run_id in every and gone not in every, every
        print("ok runs", flush=True)
        step = "read a compacted run"  # its rounds and events are in one compact record (GET)
        old = client.inspect(compacted)
        assert old.status == "done" and old.tasks["write"].rounds, old
        assert any(e.type == "run.finished" for e in client.events(compacted))
        assert client.wait(compacted, timeout=STEP_TIMEOUT_S).status == "done"
        print("ok read a compacted run", flush=True)
        step = "start a long run"
        slow = client.start("ops-slow", {})
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while not any(e.type == "phase" and (e.round or 0) >= 2 for e in client.events(slow.run_id)):
            assert time.monotonic() < deadline, "the long run did not start"
            time.sleep(0.05)
        step = "cancel"
        cancelled = client.cancel(slow.run_id, "acl test")
        assert cancelled.cancelled, cancelled
        assert slow.wait(timeout=STEP_TIMEOUT_S).status == "cancelled"
        print("ok cancel", flush=True)
        # A producer that imports its workflows settles the gates of a paused run it cancels itself,
        # in the same write that ends the run (runtime/gates.py).
        step = "cancel a run paused at a gate, with its definition"
        # started by name before the import: a start by definition would also publish the workflow's
        # shape (a SET, which the client is not given)
        gated = client.start("ops-gate", {})
        from tests.ops import flows

        assert flows.gated.name == "ops-gate"
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while client.inspect(gated.run_id).status != "waiting":
            assert time.monotonic() < deadline, "the run did not reach its gate"
            time.sleep(0.05)
        assert client.cancel(gated.run_id, "acl test").cancelled
        assert client.inspect(gated.run_id).status == "cancelled", client.inspect(gated.run_id)
        assert gated.wait(timeout=STEP_TIMEOUT_S).status == "cancelled"
        print("ok cancel a run paused at a gate, with its definition", flush=True)
    except Exception as exc:
        print(f"broken {step}: {type(exc).__name__}: {str(exc)[:500]}", flush=True)
        return 1
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
