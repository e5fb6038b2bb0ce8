"""Helpers to test distributed code on CPU: launch N gloo ranks from a test and collect results."""
from .dist import free_port, run_ranks

__all__ = ["run_ranks", "free_port"]
