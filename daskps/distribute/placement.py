"""Where variables are created: whole on one server, or split into shards.

``ParameterServerStrategy`` decides *which* server (round robin, or beside a
colocated variable); this module creates the variables there, one ``create``
call per variable or shard, all at once, and applies TensorFlow's rules for
partitioning: scalars are never split, one shard gives a plain variable,
more give a sharded one split "div"-style with shards ``name/part_i``.

It returns what it made as :class:`Placed` (server handles, shapes and
dtypes); the variables layer wraps that into ``Variable`` or
``ShardedVariable``. A create that fails anywhere leaves nothing anywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
import warnings
from typing import Any, cast

import numpy as np

from daskps._core.arrays import call_initializer, default_array, is_int
from daskps._core.config import setting
from daskps.client import protocol, refs
from daskps.client.routing import ServerRef
from daskps.distribute.partitioners import div_offsets
from daskps.server import ops
from daskps.server.ops import DenseSpec


@dataclasses.dataclass
class Part:
    """One variable (or part of one) to create on ``server``."""

    server: ServerRef
    name: str
    initial_value: Any
    shape: tuple | None
    dtype: Any
    partition_shape: tuple | None = None
    partition_offset: tuple | None = None


@dataclasses.dataclass(frozen=True)
class Created:
    """One variable (or shard) that now exists on a server."""

    ref: refs.Ref
    shape: tuple
    dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class Placed:
    """What a strategy made for one ``Variable(...)`` call."""

    name: str
    parts: list[Created]
    sharded: bool
    trainable: bool


def _spec(p: Part) -> tuple[ServerRef, ops.Create]:
    if callable(p.initial_value):
        value, init_fn = None, p.initial_value
    else:
        value = default_array(p.initial_value, "initial_value") if p.dtype is None else p.initial_value
        init_fn = None
        if p.shape is not None and np.shape(value) != p.shape:
            raise ValueError(f"initial_value has shape {np.shape(value)}, expected shape {p.shape}")
    dtype = None if p.dtype is None else np.dtype(p.dtype).str
    key = f"{p.name}@{uuid.uuid4().hex[:12]}"
    return protocol.table(p.server, key, p.name, DenseSpec(value, init_fn, p.shape, dtype, p.partition_shape,
                                                           p.partition_offset))


def create(owner: Any, parts: list[Part], whole: tuple | None = None) -> list[Created]:
    """Create ``parts`` on their servers, one call each, all at once.

    ``whole`` is ``(name, shape)`` of the variable the parts belong to. If
    any part fails, the others are dropped again and its error is raised.
    """
    specs = [_spec(p) for p in parts]
    results = protocol.create(specs, owner)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        made = [(s, op.key) for (s, op), r in zip(specs, results) if not isinstance(r, BaseException)]
        if made:
            with contextlib.suppress(Exception):  # the first error is the one to see
                protocol.release(made, owner)
        raise errors[0]
    made_all = cast(list[ops.Created], results)
    if whole is not None and any(r.sliced for r in made_all):
        _warn_if_large(*whole)
    created = [Created(refs.owned(s, op.key, op.name, owner), tuple(r.shape), np.dtype(r.dtype))
               for (s, op), r in zip(specs, made_all)]
    for (_, op), c in zip(specs, created):
        c.ref.recipe = op  # kept to make it again should its server be lost
    return created


def create_partitioned(strategy: Any, initial_value: Any, trainable: bool, name: str, dtype: Any, shape: Any) -> Placed:
    """One variable, split as ``strategy``'s partitioner decides."""
    if callable(initial_value) and (shape is None or dtype is None):
        # Without both there is nothing to partition by: build it here, as TensorFlow does.
        initial_value = call_initializer(initial_value, shape, dtype)
    if not callable(initial_value):
        if dtype is None:
            initial_value = default_array(initial_value, "initial_value")
        else:
            initial_value = np.asarray(initial_value, dtype)
        if shape is not None and initial_value.shape != shape:
            raise ValueError(f"initial_value has shape {initial_value.shape}, expected shape {shape}")
        shape, dtype = initial_value.shape, initial_value.dtype
    num = num_partitions(strategy.variable_partitioner, shape, dtype) if shape else 1
    if num == 1:
        parts = create(strategy.group, [Part(strategy.next_server(), name, initial_value, shape, dtype)])
    else:
        parts = create_div_parts(strategy, initial_value, shape, dtype, 0, num, name)
    return Placed(name, parts, num > 1, trainable)


def num_partitions(partitioner: Any, shape: tuple, dtype: np.dtype) -> int:
    """The number of shards along axis 0: at most ``shape[0]``, and one when axis 0 is empty."""
    result = partitioner(shape=shape, dtype=dtype)
    try:
        entries = list(result)
    except TypeError:
        entries = []
    # Only true ints: int() would quietly turn 1.5 into 1 and "2" into 2.
    counts = [int(x) for x in entries if is_int(x)]
    if not counts or len(counts) != len(entries) or counts[0] < 1 or any(c != 1 for c in counts[1:]):
        raise ValueError(
            "variable_partitioner must return a list of ints [num_shards >= 1, 1, 1, ...] "
            f"(only axis 0 can be split); for shape {shape} it returned {result!r}"
        )
    return max(1, min(counts[0], shape[0]))  # an empty axis 0 is one empty shard, not none


def div_specs(shape: tuple, axis: int, num: int) -> list[tuple[tuple, tuple]]:
    """``(part_shape, part_offset)`` of each "div" part along ``axis``."""
    offsets = div_offsets(shape[axis], num)
    return [
        (
            shape[:axis] + (offsets[i + 1] - offsets[i],) + shape[axis + 1 :],
            (0,) * axis + (offsets[i],) + (0,) * (len(shape) - axis - 1),
        )
        for i in range(num)
    ]


def create_div_parts(
    strategy: Any, initial_value: Any, shape: tuple, dtype: np.dtype, axis: int, num: int, name: str
) -> list[Created]:
    """Create the "div" parts of a variable along ``axis``, round robin, all at once."""
    parts = []
    for i, (part_shape, offset) in enumerate(div_specs(shape, axis, num)):
        if callable(initial_value):
            part = Part(strategy.next_server(), f"{name}/part_{i}", initial_value, shape, dtype, part_shape, offset)
        else:
            cut = initial_value[tuple(slice(o, o + n) for o, n in zip(offset, part_shape))]
            part = Part(strategy.next_server(), f"{name}/part_{i}", cut, part_shape, dtype)
        parts.append(part)
    return create(strategy.group, parts, whole=(name, shape))


def _warn_if_large(name: str, shape: tuple) -> None:
    limit = setting("large_variable_elements")
    if np.prod(shape, dtype=np.float64) > limit:
        warnings.warn(
            f"variable {name!r} of shape {shape} is partitioned, but its initializer built the "
            "whole value on each parameter server and sliced it, which needs memory for the "
            "whole variable on every server. Give shape and dtype and an initializer that "
            "accepts partition_shape and partition_offset to build each part alone.",
            ResourceWarning,
            stacklevel=8,  # the user line that made the Variable
        )
