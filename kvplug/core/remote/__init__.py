"""Calls to a remote store: deadlines, retries, a circuit breaker, the loop thread."""
