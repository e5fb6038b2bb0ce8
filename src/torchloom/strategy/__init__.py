"""Strategies: validated, ordered lists of named methods (see docs/strategy.md)."""
from .registry import Method, Stage, all_names, get_method, register_method, resolve_name, unregister_method
from .strategy import FORMAT_VERSION, MethodEntry, Strategy

__all__ = ["Strategy", "MethodEntry", "Method", "Stage", "register_method", "unregister_method", "get_method",
           "resolve_name", "all_names", "FORMAT_VERSION"]
