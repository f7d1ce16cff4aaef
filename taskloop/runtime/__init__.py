"""The runtime: the one commit path (commit.py), starting runs (starting.py), the client (client.py,
views.py, waiting.py, models.py), gate settling (gates.py), the outbox (outbox.py), the Celery
app with its message sender (celery_app.py) and the model contexts ask (judge.py)."""
