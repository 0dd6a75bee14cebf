"""``create_partitioned_variables``: TensorFlow 1's explicit "div" parts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from daskps._core.arrays import build_part
from daskps.distribute import context, placement
from daskps.distribute.partitioners import as_shape
from daskps.variables.variable import Variable

__all__ = ["create_partitioned_variables"]


def create_partitioned_variables(
    shape: Sequence[int],
    slicing: Sequence[int],
    initializer: Any,
    dtype: Any = np.float32,
    trainable: bool = True,
    name: str | None = None,
    *,
    layout: str = "div",
) -> list[Variable]:
    """Create the parts of a variable split along one axis; return them as a list.

    Parameters
    ----------
    shape : sequence of int
        The shape of the whole variable.
    slicing : sequence of int
        Number of parts along each axis; at most one entry may exceed 1. Parts
        are split "div"-style (the first parts get one extra row).
    initializer : array-like or callable
        The whole value, or a callable given whichever of ``shape`` (the whole
        shape), ``dtype``, ``partition_shape`` and ``partition_offset`` it
        accepts. In a ``ParameterServerStrategy`` scope it runs on each part's
        parameter server; a result of the whole shape is sliced there.
    dtype : numpy dtype
        Used when ``initializer`` is a callable or not a numpy array.
    name : str, optional
        Parts are named ``name/part_i``; defaults to ``"PartitionedVariable"``.
    layout : {"div", "mod"}
        ``"mod"`` (axis 0 only; TensorFlow 1's ``partition_strategy="mod"``):
        part ``i`` holds rows ``i, i + n, i + 2n, ...`` (an array initializer's
        ``value[i::n]``; a callable initializer makes each part on its own:
        its ``shape`` and ``partition_shape`` are the part's, its
        ``partition_offset`` where the part starts when the parts are laid
        end to end). Wrap the parts in
        ``ShardedVariable(parts, layout="mod")`` to use them as one variable.

    Examples
    --------
    >>> parts = create_partitioned_variables((5, 2), [2, 1], np.arange(10.0).reshape(5, 2))
    >>> [p.name for p in parts], [p.shape for p in parts]
    (['PartitionedVariable/part_0', 'PartitionedVariable/part_1'], [(3, 2), (2, 2)])
    """
    shape = as_shape(shape)
    slicing = as_shape(slicing, "slicing")
    if len(shape) != len(slicing):
        raise ValueError(f"shape and slicing must have the same length, got shape {shape} and slicing {slicing}")
    if not shape:
        raise ValueError("a partitioned variable must have rank >= 1, got shape ()")
    if any(s < 1 for s in slicing) or sum(s > 1 for s in slicing) > 1:
        raise ValueError(f"slicing must be positive with at most one entry above 1, got {slicing}")
    axis = int(np.argmax(slicing))
    if slicing[axis] > max(shape[axis], 1):
        raise ValueError(f"slicing asks for {slicing[axis]} parts of axis {axis}, which has {shape[axis]} rows")
    if layout not in ("div", "mod"):
        raise ValueError(f"layout must be 'div' or 'mod', got {layout!r}")
    if layout == "mod" and axis != 0 and slicing[axis] > 1:
        raise ValueError(f"layout='mod' splits axis 0 only, got slicing {slicing}")
    if not callable(initializer):
        if not isinstance(initializer, np.ndarray):
            initializer = np.asarray(initializer, dtype=dtype)
        if initializer.shape != shape:
            raise ValueError(f"initializer has shape {initializer.shape}, expected shape {shape}")
    name = name or "PartitionedVariable"
    if layout == "mod":
        return _create_mod(initializer, shape, np.dtype(dtype), slicing[0], name, trainable)
    return _create(initializer, shape, np.dtype(dtype), axis, slicing[axis], name, trainable)


def _strategy_in_scope() -> Any:
    """The strategy whose scope this is (checked open), or ``None`` outside any scope."""
    mode = context.current_mode()
    strategy: Any = mode.strategy
    if strategy.variable_creator is None or mode.replica_context is not None:
        return None
    if strategy.group is None:
        raise RuntimeError("variables can only be created on the coordinator, not inside a scheduled function")
    strategy.check_open("create_partitioned_variables")
    return strategy


def _create_mod(initializer: Any, shape: tuple, dtype: np.dtype, num: int, name: str, trainable: bool) -> list[Variable]:
    """Part ``i`` of ``num`` holds rows ``i::num``; each is made as a variable of its own (placed round robin)."""
    shapes = [(shape[0] // num + (i < shape[0] % num),) + shape[1:] for i in range(num)]
    # A callable gets the part's shape as both shape and partition_shape, and as partition_offset
    # where the part starts when the parts are laid end to end: distinct per part, as for "div".
    starts = np.cumsum([0] + [s[0] for s in shapes])
    offsets = [(int(starts[i]),) + (0,) * (len(shape) - 1) for i in range(num)]
    values = [initializer if callable(initializer) else initializer[i::num] for i in range(num)]
    strategy = _strategy_in_scope()
    if strategy is not None:
        made = placement.create(strategy.group, [
            placement.Part(strategy.next_server(), f"{name}/part_{i}", v, s, dtype, s if callable(v) else None,
                           o if callable(v) else None)
            for i, (v, s, o) in enumerate(zip(values, shapes, offsets))], whole=(name, shape))
        return [Variable.from_handle(p.ref, p.shape, p.dtype, trainable, strategy.token) for p in made]
    out = []
    for i, (v, s, o) in enumerate(zip(values, shapes, offsets)):
        value = build_part(None, v, s, dtype, s, o)[0] if callable(v) else v
        out.append(Variable(value, trainable=trainable, name=f"{name}/part_{i}", dtype=dtype, shape=s))
    return out


def _create(initializer: Any, shape: tuple, dtype: np.dtype, axis: int, num: int, name: str,
            trainable: bool) -> list[Variable]:
    """On the servers in a ``ParameterServerStrategy`` scope, round robin; local variables elsewhere."""
    strategy = _strategy_in_scope()
    if strategy is not None:
        parts = placement.create_div_parts(strategy, initializer, shape, dtype, axis, num, name)
        return [Variable.from_handle(p.ref, p.shape, p.dtype, trainable, strategy.token) for p in parts]
    out = []
    for i, (part_shape, offset) in enumerate(placement.div_specs(shape, axis, num)):
        fn = initializer if callable(initializer) else None
        value, _ = build_part(None if fn else initializer, fn, shape, dtype, part_shape, offset)
        out.append(Variable(value, trainable=trainable, name=f"{name}/part_{i}", dtype=dtype, shape=part_shape))
    return out
