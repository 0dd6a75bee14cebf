"""``Variable`` and ``ShardedVariable``: numpy arrays held by parameter servers.

A variable is a small handle: a :class:`~daskps.client.refs.Ref` (server and
key) plus name, shape, dtype and trainability. Reading or updating it is one
call to the server that holds it, through :mod:`daskps.client.protocol`, from
whichever process uses it. Made inside ``strategy.scope()`` it lives on a
parameter server; outside any scope it lives on this process's own server
(``daskps.client.routing.LOCAL``), as TensorFlow keeps such variables on the coordinator.

Its storage lives as long as some handle to it does, in any process.

A ``ShardedVariable`` is one logical variable split by rows over several
variables; every operation on it works out the shards and rows it touches
(:mod:`daskps.variables.rows`) and sends one call per server, all at once.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np

from daskps._core import trees, views
from daskps._core.arrays import check_trainable_flag, check_variable_args, default_array
from daskps._core.updates import BATCH_SCATTER, check_indices, check_update
from daskps.client import protocol, refs
from daskps.client.refs import Ref
from daskps.client.routing import LOCAL
from daskps.distribute import context
from daskps.server.ops import DenseSpec
from daskps.variables import rows
from daskps.variables.arraylike import ArrayLike

__all__ = ["ShardedVariable", "Variable", "new_key", "read_values", "shards_of"]


def new_key(name: str) -> str:
    """A server-side key for a new object called ``name``."""
    return f"{name}@{uuid.uuid4().hex[:12]}"


class _VariableMeta(type):
    """Routes ``Variable(...)`` to the current strategy inside its scope."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is Variable:
            mode = context.current_mode()
            creator = mode.strategy.variable_creator
            if creator is not None and mode.replica_context is None:
                return _wrap_placed(creator(*args, **kwargs), mode.strategy)
        return super().__call__(*args, **kwargs)


class Variable(ArrayLike, metaclass=_VariableMeta):
    """A mutable numpy array, on a parameter server inside ``strategy.scope()``.

    Parameters
    ----------
    initial_value : array-like or callable
        The starting value. A callable is called with whichever of ``shape``,
        ``dtype``, ``partition_shape`` and ``partition_offset`` it accepts;
        inside a strategy scope it runs on the parameter server, so a large
        value is never built on the coordinator.
    trainable : bool
        Recorded for optimizers and checkpoints.
    name : str, optional
        Defaults to ``"Variable"``.
    dtype : numpy dtype, optional
        Python floats default to float32 and ints to int32, as in TensorFlow.
    shape : tuple of int, optional
        Checked against the initial value; required by callables that need it.

    Examples
    --------
    >>> import daskps as dps
    >>> v = dps.Variable([1.0, 2.0], name="w")   # outside any scope: local
    >>> v.assign_add([0.5, 0.5]).numpy()
    array([1.5, 2.5], dtype=float32)
    >>> v.device
    '/job:chief/replica:0/task:0/device:CPU:0'
    """

    def __init__(self, initial_value: Any = None, trainable: bool = True, name: str | None = None,
                 dtype: Any = None, shape: Any = None):
        trainable = check_trainable_flag(trainable)
        name, dtype, shape = check_variable_args(initial_value, name, dtype, shape)
        init_fn = initial_value if callable(initial_value) else None
        value = None if init_fn else initial_value
        if init_fn is None and dtype is None:
            value = default_array(value, "initial_value")
        server, op = protocol.table(LOCAL, new_key(name), name,
                                    DenseSpec(value, init_fn, shape, None if dtype is None else dtype.str))
        created = protocol.create([(server, op)])[0]
        if isinstance(created, BaseException):
            raise created
        self._setup(refs.owned(server, op.key, name), created.shape, created.dtype, trainable, None)

    def _setup(self, ref: Ref, shape: tuple, dtype: Any, trainable: bool, token: str | None) -> None:
        self._ref = ref
        self._shape = shape if type(shape) is tuple else tuple(int(d) for d in shape)
        self._dtype = np.dtype(dtype)
        self._trainable = bool(trainable)
        self._strategy_token = token

    @classmethod
    def from_handle(cls, ref: Ref, shape: tuple, dtype: Any, trainable: bool, token: str | None = None) -> Variable:
        """A Variable for an object already on its server (``token``: of the strategy that made it)."""
        var = object.__new__(Variable)
        var._setup(ref, shape, dtype, trainable, token)
        return var

    def __reduce__(self) -> Any:
        if self._ref.server.is_local:
            if refs.scheduling():
                raise ValueError(
                    f"variable {self.name!r} was created outside strategy.scope(), so it lives in this "
                    "process only: a scheduled function would update a copy of it on the worker, and the "
                    "change would be lost. Create it inside `with strategy.scope():`."
                )
            return (Variable, (self.numpy(), self._trainable, self.name))  # a copy, elsewhere
        return (_rebuild, (self._ref, self._shape, self._dtype.str, self._trainable, self._strategy_token))

    # -- properties ---------------------------------------------------------
    @property
    def handle(self) -> Ref:
        """The handle of the array on its parameter server (as TensorFlow's ``Variable.handle``)."""
        return self._ref

    @property
    def strategy_token(self) -> str | None:
        """The token of the strategy whose scope made this variable (``None`` for a local variable)."""
        return self._strategy_token

    @property
    def name(self) -> str:
        return self._ref.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def device(self) -> str:
        return self._ref.server.device

    @property
    def trainable(self) -> bool:
        return self._trainable

    # -- reads and updates -------------------------------------------------
    def numpy(self) -> np.ndarray:
        """The current value, as a numpy array (a copy)."""
        return protocol.read([(self._ref, None)])[0]

    def __getitem__(self, index: Any) -> np.ndarray:
        """``value[index]`` with numpy semantics, computed where the value lives."""
        if isinstance(index, ArrayLike):
            index = index.numpy()
        elif isinstance(index, tuple):
            index = tuple(x.numpy() if isinstance(x, ArrayLike) else x for x in index)
        return protocol.read([(self._ref, index)])[0]

    def _dense(self, op: str, value: Any, arg: str) -> Variable:
        protocol.update([(self._ref, op, check_update(self._shape, self._dtype, self.name, op, value, arg))])
        return self

    def _scatter(self, op: str, payload: tuple) -> Variable:
        protocol.update([(self._ref, op, check_update(self._shape, self._dtype, self.name, op, payload))])
        return self

    def _gather(self, indices: Any, one_d: bool = False, arg: str = "indices") -> np.ndarray:
        return rows.gather_rows([self], [0, self._shape[0] if self._shape else 0], indices, self.name, one_d, arg)

    # -- Python protocol ----------------------------------------------------
    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a scalar variable")
        return self._shape[0]

    def __iter__(self) -> Iterator[np.ndarray]:
        if not self._shape:
            raise TypeError("iteration over a scalar variable")
        return iter(self.numpy())

    def _repr_html_(self) -> str:
        return views.html(_variable_view(self))

    def __repr__(self) -> str:
        return f"<daskps.Variable {self.name!r} shape={self._shape} dtype={self._dtype} device={self.device!r}>"


def _variable_view(v: Variable) -> views.VariableView:
    server = v.handle.server
    return views.VariableView(v.name, v.shape, v.dtype, v.nbytes, v.device,
                              "this process" if server.is_local else server.address)


class ShardedVariable(ArrayLike):
    """Variables that together make one larger variable, split along axis 0.

    Parameters
    ----------
    variables : list of Variable
        The shards: same dtype, same shape past axis 0.
    name : str
        The name of the whole (``ParameterServerStrategy`` uses the
        variable's name and names the shards ``name/part_i``).
    layout : {"div", "mod"}
        Which rows each shard holds. ``"div"`` (the default, TensorFlow 2's
        only layout): consecutive blocks, shard ``i`` rows
        ``row_offsets[i]:row_offsets[i + 1]``. ``"mod"`` (TensorFlow 1's
        ``partition_strategy="mod"``): row ``r`` on shard ``r % n`` at local
        row ``r // n``, so ids numbered by popularity spread evenly; the shard
        sizes are then those of a "div" split (shard ``i`` holds
        ``rows // n + (i < rows % n)`` rows).

    Examples
    --------
    >>> import daskps as dps
    >>> sv = dps.ShardedVariable([dps.Variable([[0.0], [1.0]]), dps.Variable([[2.0]])])
    >>> sv.shape, [v.shape for v in sv]
    ((3, 1), [(2, 1), (1, 1)])
    >>> sv[::-1, 0]
    array([2., 1., 0.], dtype=float32)
    >>> sv.scatter_add(dps.IndexedSlices([[5.0], [5.0]], [2, 2])).numpy()[:, 0]
    array([ 0.,  1., 12.], dtype=float32)
    """

    def __init__(self, variables: list[Variable], name: str = "ShardedVariable", *, layout: str = "div"):
        if (
            not isinstance(variables, (list, tuple))
            or not variables
            or any(not isinstance(v, Variable) for v in variables)
        ):
            raise TypeError(f"variables must be a non-empty list of daskps.Variable, got {variables!r}")
        dtypes = [v.dtype for v in variables]
        if len(set(dtypes)) > 1:
            raise ValueError(f"all variables must have the same dtype, got {[str(d) for d in dtypes]}")
        shapes = [v.shape for v in variables]
        if any(not s for s in shapes) or len({s[1:] for s in shapes}) > 1:
            raise ValueError(f"all variables must have rank >= 1 and equal shapes past axis 0, got {shapes}")
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        if layout not in ("div", "mod"):
            raise ValueError(f"layout must be 'div' or 'mod', got {layout!r}")
        self._variables = list(variables)
        self._name = name
        self._layout = layout
        offsets = [0]
        for s in shapes:
            offsets.append(offsets[-1] + s[0])
        self._offsets = tuple(offsets)
        self._shape = (self._offsets[-1],) + shapes[0][1:]
        n, total = len(variables), self._offsets[-1]
        if layout == "mod" and [s[0] for s in shapes] != [total // n + (i < total % n) for i in range(n)]:
            raise ValueError(
                f"with layout='mod' shard i holds rows i, i + {n}, i + {2 * n}, ...: {total} rows over {n} shards "
                f"need shards of {[total // n + (i < total % n) for i in range(n)]} rows, got {[s[0] for s in shapes]}"
            )

    def __reduce__(self) -> Any:
        return (_sharded, (self._variables, self._name, self._layout))

    @property
    def layout(self) -> str:
        """``"div"`` or ``"mod"``: which rows each shard holds."""
        return self._layout

    def physical(self, rows_: np.ndarray) -> np.ndarray:
        """Where rows ``rows_`` (valid row numbers) sit when the shards are laid end to end: shard ``i``'s
        rows at ``row_offsets[i]:row_offsets[i + 1]`` (for "div", the rows themselves)."""
        if self._layout == "div":
            return rows_
        n = len(self._variables)
        return np.asarray(self._offsets[:-1])[rows_ % n] + rows_ // n

    def shard_rows(self, shard: int) -> range:
        """The rows of the whole that shard ``shard`` holds, in its own order."""
        if self._layout == "div":
            return range(self._offsets[shard], self._offsets[shard + 1])
        return range(shard, self._shape[0], len(self._variables))

    def _order(self) -> np.ndarray:
        """The rows of the whole in the shards' order (shard 0's rows, then shard 1's...)."""
        return np.concatenate([np.arange(r.start, r.stop, r.step) for r in map(self.shard_rows,
                                                                                range(len(self._variables)))])

    def row_plan(self, ids: Any, arg: str = "ids") -> tuple[list[tuple[Variable, Any]], Any]:
        """What to read for rows ``ids`` (any shape; each distinct row once, one item per shard) and how
        to assemble them (:func:`daskps.read_values` and :func:`daskps.embedding_lookup` use it)."""
        if self._layout == "mod":
            ids = self.physical(check_indices(ids, self._shape[0], self._name, arg, one_d=False))
        return rows.plan_rows(self._variables, self._offsets, ids, self._name, arg=arg)

    @property
    def variables(self) -> list[Variable]:
        """The shards, in row order."""
        return list(self._variables)

    @property
    def row_offsets(self) -> tuple[int, ...]:
        """Where each shard starts along axis 0, and the total: shard ``i`` holds rows
        ``row_offsets[i]:row_offsets[i + 1]``."""
        return self._offsets

    @property
    def name(self) -> str:
        return self._name

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        return self._variables[0].dtype

    @property
    def trainable(self) -> bool:
        return all(v.trainable for v in self._variables)

    def __iter__(self) -> Iterator[Variable]:
        """Iterate over the shards (as TensorFlow does)."""
        return iter(self._variables)

    def numpy(self) -> np.ndarray:
        """The whole value: every shard read, one call per parameter server."""
        return self.from_shard_order(np.concatenate(protocol.read([(v.handle, None) for v in self._variables]), axis=0))

    def __getitem__(self, index: Any) -> np.ndarray:
        """``value[index]`` with numpy's semantics, reading only the rows touched."""
        if self._layout == "div":
            return rows.getitem(self, index)
        return rows.getitem_by_rows(self, index)

    def in_shard_order(self, whole: np.ndarray) -> np.ndarray:
        """``whole`` (an array of this variable's shape) with its rows in the shards' order."""
        return whole if self._layout == "div" else whole[self._order()]

    def from_shard_order(self, laid: np.ndarray) -> np.ndarray:
        """The whole value from the shards' values laid end to end (undoes :meth:`in_shard_order`)."""
        if self._layout == "div":
            return laid
        out = np.empty_like(laid)
        out[self._order()] = laid
        return out

    # -- updates ------------------------------------------------------------
    def _dense(self, op: str, value: Any, arg: str) -> ShardedVariable:
        payload = self.in_shard_order(check_update(self._shape, self.dtype, self._name, op, value, arg))
        protocol.update([(v.handle, op, payload[a:b]) for v, a, b in self._spans()])
        return self

    def _scatter(self, op: str, payload: tuple) -> ShardedVariable:
        idx, vals = check_update(self._shape, self.dtype, self._name, op, payload)
        if op == BATCH_SCATTER and idx.ndim > 1:
            idx, vals = self.in_shard_order(idx), self.in_shard_order(vals)
        else:
            idx = self.physical(idx)
        if op == BATCH_SCATTER and idx.ndim > 1:  # batch axis 0 is the sharded axis
            items = [(v.handle, op, (idx[a:b], vals[a:b])) for v, a, b in self._spans()]
        else:
            parts = rows.split_rows(self._offsets, idx, vals)
            items = [(v.handle, op, part) for v, part in zip(self._variables, parts) if len(part[0])]
        protocol.update(items)
        return self

    def _gather(self, indices: Any, one_d: bool = False, arg: str = "indices") -> np.ndarray:
        if self._layout == "mod":
            indices = self.physical(check_indices(indices, self._shape[0], self._name, arg, one_d=one_d))
        return rows.gather_rows(self._variables, self._offsets, indices, self._name, one_d, arg)

    def _spans(self) -> list[tuple[Variable, int, int]]:
        return [(v, self._offsets[i], self._offsets[i + 1]) for i, v in enumerate(self._variables)]

    def _repr_html_(self) -> str:
        n, offsets = len(self._variables), self._offsets
        spans = [f"{offsets[i]}:{offsets[i + 1]}" if self._layout == "div" else f"{i}::{n}" for i in range(n)]
        return views.html(views.ShardedView(self._name, self._shape, self.dtype, self.nbytes,
                                            [(_variable_view(v), span) for v, span in zip(self._variables, spans)]))

    def __repr__(self) -> str:
        layout = "" if self._layout == "div" else f" layout={self._layout!r}"
        return (
            f"<daskps.ShardedVariable {self._name!r} shape={self._shape} dtype={self.dtype} "
            f"shards={len(self._variables)}{layout}>"
        )


def _sharded(variables: list[Variable], name: str, layout: str = "div") -> ShardedVariable:
    return ShardedVariable(variables, name, layout=layout)


def _rebuild(ref: Ref, shape: tuple, dtype: str, trainable: bool, token: str | None) -> Variable:
    return Variable.from_handle(ref, shape, dtype, trainable, token)


def _wrap_placed(placed: Any, strategy: Any) -> Any:
    """Variables (or a ShardedVariable) for what a strategy's placement created."""
    parts = [Variable.from_handle(p.ref, p.shape, p.dtype, placed.trainable, strategy.token) for p in placed.parts]
    return ShardedVariable(parts, name=placed.name) if placed.sharded else parts[0]


def shards_of(v: Any, arg: str = "variables") -> list[Variable]:
    """The variables ``v`` is made of: itself, or a ShardedVariable's shards."""
    parts = v.variables if isinstance(v, ShardedVariable) else None
    if parts is not None:
        return list(parts)
    if not isinstance(v, Variable):
        raise TypeError(f"{arg} must contain Variables or ShardedVariables, got {type(v).__name__}")
    return [v]


def read_values(variables: Any) -> Any:
    """Read many variables, and rows of tables, with one round trip per parameter server.

    Parameters
    ----------
    variables : a tree (or iterable) of Variable, ShardedVariable, or ``(table, ids)``
        Any structure :func:`daskps.create_variables` accepts: a list, or a
        model's parameter tree of nested dicts, lists, tuples, namedtuples,
        dataclasses or JAX pytrees. A ``(table, ids)`` pair reads the rows
        ``ids`` (any shape) of a Variable, ShardedVariable or EmbeddingTable, as
        ``dps.embedding_lookup(table, ids)`` does, in the same messages as
        everything else. Leaves that are not arrays (``None``, strings,
        numbers: what ``create_variables`` leaves as they are) are returned
        as they are.

    Returns
    -------
    The same structure with a numpy array in place of each variable (a list
    when given an iterator).

    Examples
    --------
    >>> import daskps as dps
    >>> a, b = dps.Variable(1.0), dps.Variable([[2, 3], [4, 5]])
    >>> dps.read_values([a, b, (b, [1, 1])])
    [array(1., dtype=float32), array([[2, 3],
           [4, 5]], dtype=int32), array([[4, 5],
           [4, 5]], dtype=int32)]
    >>> dps.read_values({"w": a, "layers": [b]})["layers"][0].shape
    (2, 2)
    """
    if not isinstance(variables, (list, tuple, dict)) and not trees.is_array(variables) and hasattr(variables, "__next__"):
        variables = list(variables)
    rebuild: Any = list
    if isinstance(variables, list) and all(isinstance(v, (Variable, ShardedVariable)) for v in variables):
        paths, leaves = [(i,) for i in range(len(variables))], variables  # the common case, fast
    else:
        paths, leaves, rebuild = trees.flatten(variables, is_leaf=_is_row_read)
    plans: list[Any] = []
    for path, leaf in zip(paths, leaves):
        if not trees.is_array(leaf) and not isinstance(leaf, tuple):  # None, a name: as create_variables left it
            plans.append(([], lambda _, leaf=leaf: leaf))
            continue
        try:
            plans.append(_plan(leaf))
        except (TypeError, ValueError) as exc:
            if not path:
                raise
            raise type(exc)(f"variables at {trees.describe(path)}: {exc}") from None
    values = protocol.read([(leaf.handle, index) for items, _ in plans for leaf, index in items])
    out, i = [], 0
    for items, assemble in plans:
        out.append(assemble(values[i : i + len(items)]))
        i += len(items)
    return rebuild(out)


def _is_row_read(node: Any) -> bool:
    """A ``(table, ids)`` pair: a plain tuple of a variable and ids that hold no variable and no name.

    A namedtuple (a layer's fields) and a pair whose second item holds a
    string (an activation's name) are part of the parameter tree instead.
    """
    if not (type(node) is tuple and len(node) == 2
            and (isinstance(node[0], (Variable, ShardedVariable)) or hasattr(node[0], "row_plan"))):
        return False
    leaves = trees.flatten(node[1])[1]
    return all(x is not None and not isinstance(x, (Variable, ShardedVariable, str, bytes)) for x in leaves)


def _plan(v: Any) -> tuple[list[tuple[Variable, Any]], Any]:
    if isinstance(v, tuple) and len(v) == 2:
        table, ids = v
        if callable(getattr(ids, "plan", None)):  # a dps.Bags: pooled on the servers
            return ids.plan(table)
        if hasattr(table, "row_plan"):  # an EmbeddingTable or a ShardedVariable
            return table.row_plan(ids)
        shards = shards_of(table)
        offsets = table.row_offsets if isinstance(table, ShardedVariable) else (0, table.shape[0] if table.shape else 0)
        return rows.plan_rows(shards, offsets, ids, table.name)
    shards = shards_of(v)
    if isinstance(v, ShardedVariable):
        return [(s, None) for s in shards], lambda values: v.from_shard_order(np.concatenate(values))
    return [(s, None) for s in shards], lambda values: values[0] if len(values) == 1 else np.concatenate(values)
