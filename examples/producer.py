"""A producer service: it starts runs by workflow name and never imports the workflow code (the
workers have it). Run a worker first: ``taskloop worker --import examples.workflows``.

    python -m examples.producer            # starts 5 essays and 5 report revisions, waits for all
"""

from __future__ import annotations

import taskloop as tl


def main() -> None:
    client = tl.TaskLoop()  # TASKLOOP_REDIS_URL, default redis://127.0.0.1:6379/0
    runs = [client.start("essay", {"topic": f"topic {n}"}) for n in range(5)]
    runs += [client.start("report-revision", {"approve_in": n % 3}) for n in range(5)]
    for run in runs:
        result = run.wait(timeout=60)
        state = client.inspect(run.run_id).state  # a graph run's business state (None for the others)
        print(run.run_id, result.status, result.values if state is None else state)


if __name__ == "__main__":
    main()
