"""Parameter trees: the nested structures models keep their parameters in.

A model's parameters come as a tree: dicts, lists, tuples, namedtuples and
dataclasses of arrays (JAX, flax, equinox), a ``torch.nn.Module``, or a
Keras 3 model. :func:`flatten` lists the leaves with their *paths* (dict
keys, sequence indices, field names) and gives back a function that builds
the same structure around new leaves, so a tree of arrays becomes a tree of
variables, a tree of variables a tree of values, and a tree of gradients is
matched to a tree of variables path by path.

- A ``torch.nn.Module`` is the dict of its ``named_parameters()``, and a
  Keras model (any Keras layer) the dict of its ``trainable_variables`` by
  ``variable.path``: rebuilding gives that dict, not the module.
- Any other type that JAX knows as a pytree node is split as JAX splits
  it, when JAX has been imported (its path keys named as JAX names them).
- Arrays (anything with ``__array__`` or ``__dlpack__``) and ``None`` are
  leaves, as is anything of no kind above.

Nothing here imports JAX, PyTorch or Keras: a tree can only hold their
objects if the user imported them already.

>>> paths, leaves, rebuild = flatten({"dense": {"kernel": 1, "bias": 2}, "layers": [3]})
>>> [join(p) for p in paths], leaves
(['dense/kernel', 'dense/bias', 'layers/0'], [1, 2, 3])
>>> rebuild([10, 20, 30])
{'dense': {'kernel': 10, 'bias': 20}, 'layers': [30]}
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

Path = tuple[Any, ...]
Rebuild = Callable[[Sequence[Any]], Any]


def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Path], list[Any], Rebuild]:
    """``(paths, leaves, rebuild)``: the leaves depth first, and how to put new ones in their places.

    ``is_leaf(node)`` may declare more nodes leaves (checked first).
    """
    paths: list[Path] = []
    leaves: list[Any] = []
    rebuild = _flatten(tree, (), paths, leaves, is_leaf)
    return paths, leaves, lambda new: rebuild(iter(new))


def join(path: Path) -> str:
    """A path as a name: its keys joined by ``/`` (``("dense", "kernel")`` -> ``"dense/kernel"``)."""
    return "/".join(str(k) for k in path)


def describe(path: Path) -> str:
    """A path for an error message."""
    return repr(join(path)) if path else "the root"


def is_array(x: Any) -> bool:
    """Whether ``x`` is an array leaf: numpy, or anything with ``__array__`` or ``__dlpack__``."""
    return isinstance(x, (np.ndarray, np.generic)) or hasattr(x, "__array__") or hasattr(x, "__dlpack__")


def to_numpy(x: Any) -> np.ndarray:
    """``x`` as a numpy array: numpy as is; JAX arrays, torch tensors (detached, on the CPU) and others."""
    if isinstance(x, np.ndarray):
        return x
    detach = getattr(x, "detach", None)  # a torch tensor that requires grad refuses __array__
    if callable(detach) and hasattr(x, "cpu"):
        x = detach().cpu()
    try:
        arr = np.asarray(x)
    except Exception:
        if hasattr(x, "__dlpack__"):
            return np.from_dlpack(x)
        raise
    if arr.dtype == object and hasattr(x, "__dlpack__"):
        return np.from_dlpack(x)  # no __array__: numpy wrapped the object itself
    return arr


def _flatten(node: Any, path: Path, paths: list[Path], leaves: list[Any],
             is_leaf: Callable[[Any], bool] | None) -> Callable[[Any], Any]:
    split = None if (is_leaf is not None and is_leaf(node)) else _split(node)
    if split is None:
        paths.append(path)
        leaves.append(node)
        return next
    items, make = split
    parts = [_flatten(child, (*path, key), paths, leaves, is_leaf) for key, child in items]
    return lambda new: make([part(new) for part in parts])


def _split(node: Any) -> tuple[list[tuple[Any, Any]], Callable[[list[Any]], Any]] | None:
    """``(children by key, how to make the node from new children)``, or ``None`` for a leaf."""
    if node is None or isinstance(node, (str, bytes)) or is_array(node):
        return None
    if isinstance(node, dict):
        keys = list(node)
        return list(node.items()), lambda vals: _remake_dict(node, keys, vals)
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return list(zip(node._fields, node)), lambda vals: type(node)(*vals)
    if isinstance(node, (list, tuple)):
        kind = type(node)
        return list(enumerate(node)), lambda vals: kind(vals)
    named = _framework_parameters(node)
    if named is not None:
        return _split(named)
    split = _jax_split(node)
    if split is not None:
        return split
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        names = [f.name for f in dataclasses.fields(node) if f.init]
        return [(n, getattr(node, n)) for n in names], lambda vals: dataclasses.replace(node, **dict(zip(names, vals)))
    return None


def _remake_dict(node: dict, keys: list[Any], vals: list[Any]) -> dict:
    try:
        return type(node)(zip(keys, vals))
    except TypeError:  # a dict subclass with another constructor (defaultdict...)
        return dict(zip(keys, vals))


def _framework_parameters(node: Any) -> dict[str, Any] | None:
    """A torch module's ``named_parameters()``, or a Keras layer's trainable variables by path."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(node, torch.nn.Module):
        return dict(node.named_parameters())
    keras = sys.modules.get("keras")
    layer = getattr(getattr(keras, "layers", None), "Layer", None)
    if layer is not None and isinstance(node, layer):
        return {v.path: v for v in node.trainable_variables}
    return None


def _jax_split(node: Any) -> tuple[list[tuple[Any, Any]], Callable[[list[Any]], Any]] | None:
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    tu = jax.tree_util
    flat, treedef = tu.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # JAX sees a leaf
        return None
    return [(jax_key(path[0]), child) for path, child in flat], lambda vals: tu.tree_unflatten(treedef, vals)


def jax_key(key: Any) -> Any:
    """One step of a JAX key path as a tree path item: a dict key, an attribute name or an index."""
    for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey / FlattenedIndexKey
        if hasattr(key, attr):
            return getattr(key, attr)
    return str(key)


def match(paths: list[Path], other: list[Path], what: str, against: str) -> list[int]:
    """For each of ``paths``, the index of the same path in ``other``; a ``ValueError`` names the first difference.

    >>> match([("a",), ("b",)], [("b",), ("a",)], "grads", "variables")
    [1, 0]
    """
    where = {p: i for i, p in enumerate(other)}
    missing = next((p for p in paths if p not in where), None)
    extra = next((p for p in other if p not in set(paths)), None)
    if missing is not None or extra is not None or len(paths) != len(other):
        detail = (f"{against} has {describe(missing)}, which {what} lacks" if missing is not None
                  else f"{what} has {describe(extra)}, which {against} lacks" if extra is not None
                  else "a path repeats")
        raise ValueError(f"{what} must have the structure of {against}: {detail}")
    return [where[p] for p in paths]
