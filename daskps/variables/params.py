"""A model's parameter tree as variables on the parameter servers.

``create_variables`` turns a tree of arrays (a JAX/flax/equinox pytree,
nested dicts and lists, a ``torch.nn.Module``, a Keras 3 model) into the
same tree of variables, named after their paths; ``read_values`` reads such
a tree back in one round trip per server, and ``optimizer.apply`` takes a
gradient tree of the same structure. See :mod:`daskps._core.trees` for the
structures understood.
"""

from __future__ import annotations

from typing import Any

from daskps._core import trees
from daskps.variables.variable import ShardedVariable, Variable

__all__ = ["create_variables"]


def create_variables(tree: Any, name: str | None = None, trainable: bool = True) -> Any:
    """Make a variable for every array leaf of ``tree``, in the same structure.

    Inside ``strategy.scope()`` each lands on a parameter server, or is a
    ``ShardedVariable`` when the strategy's partitioner splits it; outside
    any scope the variables are local, as ``dps.Variable`` makes them.

    Parameters
    ----------
    tree : nested dicts, lists, tuples, namedtuples, dataclasses, a JAX pytree, a ``torch.nn.Module`` or a Keras 3 model
        Leaves that are arrays (numpy, JAX, torch, Keras variables: anything
        with ``__array__`` or ``__dlpack__``) become variables with their
        value, shape and dtype; other leaves (``None``, strings, numbers)
        stay as they are. A torch module becomes the dict of its
        ``named_parameters()``; a Keras model the dict of its
        ``trainable_variables`` keyed by ``variable.path``, in that order.
    name : str, optional
        Prefix of the variables' names: a leaf at path ``("dense", "kernel")``
        is named ``name + "/dense/kernel"`` (sequence items by index:
        ``"mlp/layers/0"``); without ``name``, just the path.
    trainable : bool

    Returns
    -------
    The same structure, a variable in place of every array leaf.

    Examples
    --------
    >>> import numpy as np, daskps as dps
    >>> params = {"dense": {"kernel": np.ones((3, 2), np.float32), "bias": np.zeros(2, np.float32)}}
    >>> variables = dps.create_variables(params, name="mlp")
    >>> variables["dense"]["kernel"].name, variables["dense"]["bias"].shape
    ('mlp/dense/kernel', (2,))
    """
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a string or None, got {type(name).__name__}")
    paths, leaves, rebuild = trees.flatten(tree)
    made = []
    for path, leaf in zip(paths, leaves):
        if not trees.is_array(leaf) or isinstance(leaf, (Variable, ShardedVariable)):
            made.append(leaf)
            continue
        value = trees.to_numpy(leaf)
        full = "/".join(p for p in (name, trees.join(path)) if p) or None
        made.append(Variable(value, trainable=trainable, name=full, dtype=value.dtype))
    return rebuild(made)
