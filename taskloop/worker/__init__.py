"""The worker side: the Celery tasks (tasks.py) and the app they are registered on (app.py), the
executor that runs one phase message, what an outcome comes to (outcomes.py), recovery of lost
executions and bad records (worker/recovery/executions.py), calling user code (callbacks.py), the cache, the
watcher thread, the reconciler, starting runs by name (starter.py) and the worker supervisor."""
