"""The inputs ``dps.keras`` takes, as batches each trainer makes itself.

Arrays (numpy, or dicts, lists and tuples of them) travel to each trainer
once, through a per-worker dataset; every step then carries only which rows
its batches hold (a slice, or the indices of a shuffled epoch), so each
epoch's batches are handed out exactly once across the trainers, in order
when ``shuffle=False``, as Keras makes them (the last batch holds the rest).
A ``dataset_fn`` is built on each trainer, as
``coordinator.create_per_worker_dataset`` builds it, and each step takes the
next element of its trainer's own iterator.
"""

from __future__ import annotations

import inspect
import itertools
import math
import warnings
from typing import Any, NamedTuple

import numpy as np

__all__ = ["ArrayData", "DaskDraw", "Plan", "Repeat", "Step", "as_source"]


class Repeat:
    """A ``dataset_fn`` whose dataset is ``obj`` over and over: ``obj`` reaches each trainer once."""

    def __init__(self, obj: Any):
        self.obj = obj

    def __call__(self) -> Any:
        return itertools.repeat(self.obj)


class Step(NamedTuple):
    """One scheduled execution: Keras' first and last batch index in the epoch, and what its batches are."""

    begin: int
    end: int
    payload: Any  # a list of row selections (arrays), or a number of batches to draw (a dataset_fn)


class DaskDraw(NamedTuple):
    """A step's batches from a Dask collection: how many to draw from the cluster's queue, and how each
    component of a batch becomes what Keras takes ("frame": a DataFrame's columns stacked into a matrix,
    "series": its one column, "array": as it is)."""

    batches: int
    kinds: tuple[str, ...]

    def convert(self, batch: Any) -> tuple[Any, ...]:
        parts = batch if isinstance(batch, tuple) else (batch,)
        out = []
        for kind, part in zip(self.kinds, parts):
            if kind == "frame":
                part = np.stack([np.asarray(c) for c in part.values()], axis=1)
            elif kind == "series":
                part = np.asarray(next(iter(part.values())))
            out.append(part)
        return tuple(out)


def _leaves(structure: Any, arg: str) -> list[Any]:
    import keras

    leaves = keras.tree.flatten(structure)
    for leaf in leaves:
        if leaf is not None and not hasattr(leaf, "__array__"):
            raise TypeError(f"{arg} must be numpy arrays (or dicts, lists or tuples of them), a per-worker "
                            f"dataset_fn, or None; found {type(leaf).__name__}")
    return leaves


def _as_numpy(structure: Any) -> Any:
    import keras

    if structure is None:
        return None
    return keras.tree.map_structure(lambda a: None if a is None else np.asarray(a), structure)


class ArrayData:
    """Arrays held on each trainer; ``batch(rows)`` is one batch as Keras' data adapter makes it."""

    def __init__(self, x: Any, y: Any = None, sample_weight: Any = None, class_weight: dict | None = None):
        self.x, self.y, self.sample_weight, self.class_weight = x, y, sample_weight, class_weight

    def batch(self, rows: Any) -> tuple[Any, ...]:
        import keras
        from keras.src.trainers.data_adapters import data_adapter_utils

        take = lambda a: a[rows]  # noqa: E731
        x = keras.tree.map_structure(take, self.x)
        y = None if self.y is None else keras.tree.map_structure(take, self.y)
        sw = None if self.sample_weight is None else keras.tree.map_structure(take, self.sample_weight)
        if self.class_weight is not None and y is not None:
            sw = data_adapter_utils.class_weight_to_sample_weights(y, self.class_weight)
        return data_adapter_utils.pack_x_y_sample_weight(x, y, sw)


class Plan:
    """Where an input's batches come from: on the trainers (``source``) and, per epoch, the steps."""

    def __init__(self, source: Any, num_rows: int | None, batch_size: int | None, steps_per_epoch: int | None,
                 steps_per_execution: int, shuffle: Any, dask: tuple[Any, tuple[str, ...]] | None = None):
        self.source = source  # an ArrayData (sent once) or a dataset_fn (built on each trainer)
        self.dask = dask  # a Dask input: (the collections to read, what each is), batched when the fit starts
        self.num_rows = num_rows
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.steps_per_execution = steps_per_execution
        self.steps_cap = steps_per_epoch
        self.left: list[Any] = []  # with steps_per_epoch, the batches of the current pass not trained yet
        if num_rows is None:
            self.num_batches = steps_per_epoch
        else:
            available = math.ceil(num_rows / batch_size) if batch_size else 0
            self.num_batches = available if steps_per_epoch is None else min(steps_per_epoch, available)
            if steps_per_epoch is not None and steps_per_epoch > available:
                warnings.warn(f"steps_per_epoch={steps_per_epoch} is more than the {available} batches of "
                              f"{batch_size} the {num_rows} rows make: each epoch runs {available}", stacklevel=3)

    @property
    def is_arrays(self) -> bool:
        return self.num_rows is not None and self.dask is None

    def dask_dataset(self, coordinator: Any, passes: int) -> Any:
        """The per-worker dataset of a Dask input: ``passes`` epochs, each batch handed out exactly once.

        Counts the batches of an epoch (rows per partition are counted where
        the partitions live) and sets ``num_batches`` from them.
        """
        from daskps.distribute.dask_data import from_dask

        parts, _ = self.dask  # type: ignore[misc]
        assert self.batch_size is not None
        dataset = coordinator.create_per_worker_dataset(from_dask(
            parts, self.batch_size, shuffle=self.shuffle is not False, epochs=max(1, passes), exactly_once=True))
        rows = dataset.dataset_fn.rows
        available = sum(math.ceil(r / self.batch_size) for r in rows)
        self.num_rows = sum(rows)
        self.num_batches = available if self.steps_cap is None else min(self.steps_cap, available)
        return dataset

    def first_batch(self) -> Any:
        """A small batch on the coordinator, for Keras to build the metrics (arrays only)."""
        return self.source.batch(slice(0, min(2, self.num_rows or 0)))

    def epoch(self) -> list[Step]:
        """The steps of one epoch, each ``steps_per_execution`` batches (the last may hold fewer)."""
        assert self.num_batches is not None
        k = self.steps_per_execution
        if self.dask is not None:
            kinds = self.dask[1]
            return [Step(b, b + k - 1, DaskDraw(min(k, self.num_batches - b), kinds))
                    for b in range(0, self.num_batches, k)]
        if not self.is_arrays:
            return [Step(b, b + k - 1, min(k, self.num_batches - b)) for b in range(0, self.num_batches, k)]
        if self.steps_cap is not None:
            # As Keras: an epoch of steps_per_epoch batches goes on from where the last one stopped; one
            # that reaches the end of the data ends there, and the next starts a new pass.
            if not self.left:
                self.left = self._pass()
            rows, self.left = self.left[: self.num_batches], self.left[self.num_batches:]
        else:
            rows = self._pass()[: self.num_batches]
        # Keras names an execution by its first batch and first + steps_per_execution - 1, the last one too
        return [Step(b, b + k - 1, rows[b:b + k]) for b in range(0, len(rows), k)]

    def _pass(self) -> list[Any]:
        """The row selections of one pass over the arrays, shuffled as asked."""
        n, bs = self.num_rows, self.batch_size
        assert n is not None and bs is not None
        if self.shuffle is True:
            order = np.random.permutation(n)  # numpy's global generator: keras.utils.set_random_seed seeds it
            return [order[i:i + bs] for i in range(0, n, bs)]
        if self.shuffle == "batch":  # as Keras: the batches in order, the rows within each shuffled
            return [i + np.random.permutation(min(bs, n - i)) for i in range(0, n, bs)]
        return [slice(i, min(i + bs, n)) for i in range(0, n, bs)]


def _dataset_fn(x: Any) -> bool:
    return callable(x) and not hasattr(x, "shape") and not isinstance(x, (dict, list, tuple))


def _is_dask(x: Any) -> bool:
    return type(x).__module__.split(".")[0] in ("dask", "dask_expr")


def as_source(x: Any, y: Any, sample_weight: Any, class_weight: Any, batch_size: Any, steps: Any,
              steps_per_execution: int, shuffle: Any, *, what: str, steps_arg: str, need_y: bool) -> Plan:
    """Check one input (``x`` and what goes with it) and say how its batches are made.

    ``what`` names the input in messages (``"x"``, ``"validation_data"``);
    ``steps_arg`` is the argument that bounds an epoch (``steps_per_epoch``,
    ``validation_steps``, ``steps``).
    """
    import keras

    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1):
        raise ValueError(f"{steps_arg} must be a positive integer or None, got {steps!r}")
    if _is_dask(x) or _is_dask(y) or _is_dask(sample_weight):
        return _dask_plan(x, y, sample_weight, class_weight, batch_size, steps, steps_per_execution, shuffle,
                          what=what, need_y=need_y)
    if _dataset_fn(x):
        for arg, value in (("y", y), ("sample_weight", sample_weight), ("class_weight", class_weight),
                           ("batch_size", batch_size)):
            if value is not None:
                raise ValueError(f"{arg} must be None when {what} is a dataset_fn (its batches carry the "
                                 f"labels and their size), got {type(value).__name__}")
        if steps is None:
            raise ValueError(f"{steps_arg} is required when {what} is a dataset_fn: a per-worker dataset "
                             "has no end that the coordinator can see (as in TensorFlow)")
        try:
            inspect.signature(x)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{what} must be a function of () or (input_context), got {x!r}") from exc
        return Plan(x, None, None, int(steps), steps_per_execution, False)
    if x is None:
        raise ValueError(f"{what} must be given: numpy arrays (or dicts of them) or a per-worker dataset_fn")
    _checked_batch_size(batch_size)
    if need_y and y is None:
        raise ValueError(f"y must be given with {what} as arrays: the model was compiled with a loss that "
                         "compares predictions with targets")
    if class_weight is not None:
        if sample_weight is not None:
            raise ValueError("class_weight and sample_weight cannot both be given (as in Keras)")
        if not isinstance(class_weight, dict):
            raise TypeError(f"class_weight must be a dict of class index to weight, got {type(class_weight).__name__}")
    for arg, part in (("x", x), ("y", y), ("sample_weight", sample_weight)):
        _leaves(part, arg if what == "x" else f"{what}'s {arg}")
    x, y, sample_weight = _as_numpy(x), _as_numpy(y), _as_numpy(sample_weight)
    lengths: dict[str, set[int]] = {}
    for arg, part in (("x", x), ("y", y), ("sample_weight", sample_weight)):
        if part is None:
            continue
        for leaf in keras.tree.flatten(part):
            if leaf.ndim == 0:
                raise ValueError(f"{arg} must be arrays with a first (batch) dimension, got a scalar")
            lengths.setdefault(arg, set()).add(int(leaf.shape[0]))
    sizes = set().union(*lengths.values()) if lengths else set()
    if len(sizes) != 1:
        detail = ", ".join(f"{a}: {sorted(s)}" for a, s in lengths.items())
        raise ValueError(f"every array of {what} must have the same number of rows, got {detail}")
    rows = sizes.pop()
    if batch_size is None:  # as Keras: with a number of steps, batches that cover the rows in that many
        batch_size = 32 if steps is None else max(1, math.ceil(rows / steps))
    return Plan(ArrayData(x, y, sample_weight, class_weight), rows, int(batch_size),
                None if steps is None else int(steps),
                steps_per_execution, shuffle)


def _checked_batch_size(batch_size: Any) -> Any:
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                                   or batch_size < 1):
        raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
    return batch_size


def _dask_kind(part: Any, arg: str) -> tuple[Any, str]:
    """A Dask collection as ``from_dask`` reads it, and how its batches become Keras' input."""
    name = type(part).__name__
    if name == "Series":
        return part.to_frame(), "series"
    if name == "DataFrame":
        return part, "frame"
    if name == "Array":
        return part, "array"
    raise TypeError(f"{arg} must be a dask Array, DataFrame or Series when any input is a Dask collection "
                    f"(all of x, y and sample_weight then), got {type(part).__module__}.{name}")


def _dask_plan(x: Any, y: Any, sample_weight: Any, class_weight: Any, batch_size: Any, steps: Any,
               steps_per_execution: int, shuffle: Any, *, what: str, need_y: bool) -> Plan:
    """A Dask input: read on the trainers that hold its partitions, each batch once (``from_dask``'s
    ``exactly_once``), a DataFrame's columns stacked into one matrix as Keras takes a pandas one."""
    if class_weight is not None:
        raise ValueError("class_weight is not taken with Dask input: give sample_weight as a dask Array")
    if need_y and y is None:
        raise ValueError(f"y must be given with {what} as a Dask collection: the model was compiled with a loss "
                         "that compares predictions with targets")
    batch_size = 32 if _checked_batch_size(batch_size) is None else batch_size
    parts, kinds = [], []
    for arg, part in (("x", x), ("y", y), ("sample_weight", sample_weight)):
        if part is None:
            continue
        if not _is_dask(part):
            raise TypeError(f"{arg} must be a Dask collection too when another input is one, got "
                            f"{type(part).__name__}")
        collection, kind = _dask_kind(part, arg if what == "x" else f"{what}'s {arg}")
        parts.append(collection)
        kinds.append(kind)
    return Plan(None, None, int(batch_size), None if steps is None else int(steps), steps_per_execution, shuffle,
                dask=(tuple(parts), tuple(kinds)))


def validation_parts(validation_data: Any) -> tuple[Any, Any, Any]:
    """``(x, y, sample_weight)`` of Keras' ``validation_data`` (a tuple, or a dataset_fn)."""
    if validation_data is None or _dataset_fn(validation_data):
        return validation_data, None, None
    if isinstance(validation_data, (tuple, list)) and len(validation_data) in (2, 3):
        parts = list(validation_data) + [None] * (3 - len(validation_data))
        return parts[0], parts[1], parts[2]
    raise ValueError("validation_data must be a tuple (x_val, y_val) or (x_val, y_val, val_sample_weight), "
                     f"or a per-worker dataset_fn; got {type(validation_data).__name__}")


def is_dataset_fn(x: Any) -> bool:
    return _dataset_fn(x)

