"""Runnable examples (see README.md and docs/graphs.md)."""
