"""Operations: Prometheus metrics (metrics.py) and a private redis-server (embedded.py)."""
