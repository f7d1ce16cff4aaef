"""Every connection taskloop makes: Redis URLs (urls.py), the store's client (clients.py, with
sentinel.py), the Celery broker (broker.py), what redis-py's errors mean (errors.py), and the
chat-completions endpoint of until_llm and llm_check (llm.py)."""
