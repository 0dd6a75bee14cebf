"""Tiny helpers for nested lists, tuples and dicts (a small ``tf.nest``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def map_structure(fn: Callable[[Any], Any], structure: Any) -> Any:
    """Apply ``fn`` to every leaf of nested lists, tuples and dicts."""
    if isinstance(structure, dict):
        return type(structure)((k, map_structure(fn, v)) for k, v in structure.items())
    if isinstance(structure, tuple) and hasattr(structure, "_fields"):
        return type(structure)(*(map_structure(fn, v) for v in structure))
    if isinstance(structure, (list, tuple)):
        return type(structure)(map_structure(fn, v) for v in structure)
    return fn(structure)


def flatten(structure: Any) -> list[Any]:
    """The leaves of nested lists, tuples and dicts, depth first."""
    leaves: list[Any] = []
    map_structure(leaves.append, structure)
    return leaves
