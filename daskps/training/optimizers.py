"""Optimizers that run on the parameter servers, beside the variables.

Each optimizer wraps a pure transform from :mod:`daskps._core.transforms`
(optax's style: ``init(param) -> state`` and ``update(grad, state, param) ->
(updates, state)``, with state a typed ``NamedTuple``). The transform is sent
to every parameter server once, when the optimizer is made; after that a
step names the optimizer by key. ``apply_gradients`` groups the gradients
by server and sends each server one call; the server keeps the state next
to the variable (or shard) and applies the update there. ``iterations``
lives on a server too and is bumped within one of those calls.

The arithmetic is Keras 3's for optimizers of the same name and arguments,
``weight_decay`` (decoupled, applied before the step with that step's
learning rate), gradient clipping and learning-rate schedules included.
Clipping runs here, on the trainer, before a gradient is split into
shards; everything else runs on the servers. A variable's step (for
schedules and bias corrections) is the number of updates it has had, kept
in its state: Keras' ``iterations`` when every step updates every variable.

>>> import daskps as dps
>>> w = dps.Variable([1.0, 2.0])
>>> opt = dps.optimizers.SGD(learning_rate=0.1)
>>> opt.apply_gradients([(np.array([1.0, 1.0], np.float32), w)]).numpy()
array(1)
>>> w.numpy()
array([0.9, 1.9], dtype=float32)
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from daskps._core import clipping, schedules, transforms, trees
from daskps._core.slices import IndexedSlices
from daskps._core.updates import check_gradient, coerce_values
from daskps.client import protocol, refs
from daskps.client.routing import LOCAL
from daskps.distribute import context
from daskps.server import ops
from daskps.variables import rows
from daskps.variables.bags import PooledSlices, check_pooled
from daskps.variables.hashed import EmbeddingTable
from daskps.variables.variable import ShardedVariable, Variable, shards_of

__all__ = ["Optimizer"]


def is_number(value: Any) -> bool:
    """Whether ``value`` is a finite real number (``bool`` is not one: ``True`` as a rate is a mistake)."""
    ok = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, (bool, np.bool_))
    return ok and bool(np.isfinite(value))


def check_positive(value: Any, arg: str, allow_zero: bool = False) -> float:
    if not is_number(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{arg} must be a {'non-negative' if allow_zero else 'positive'} finite number, "
                         f"got {value!r}")
    return float(value)


def check_rate(value: Any) -> Any:
    """A learning rate: a positive number, or a schedule (kept as it is, to travel to the servers)."""
    if isinstance(value, schedules.LearningRateSchedule):
        return value
    if not is_number(value):
        raise ValueError(f"learning_rate must be a positive finite number or a LearningRateSchedule, got {value!r}")
    return check_positive(value, "learning_rate")


def check_optional(value: Any, arg: str, allow_zero: bool = True) -> float | None:
    return None if value is None else check_positive(value, arg, allow_zero)


def check_unit(value: Any, arg: str, low_open: bool = False, high_open: bool = True) -> float:
    """A number in [0, 1) (or with other ends open or closed, as ``low_open``/``high_open`` say)."""
    if not is_number(value) or value < 0 or (low_open and value == 0) or value > 1 or (high_open and value == 1):
        raise ValueError(f"{arg} must be in {'(' if low_open else '['}0, 1{')' if high_open else ']'}, got {value!r}")
    return float(value)


def check_flag(value: Any, arg: str) -> bool:
    """``True`` or ``False``; anything else (``"no"`` is truthy) is refused rather than read as one."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{arg} must be True or False, got {value!r}")
    return bool(value)


class Optimizer:
    """Base class: a transform, its state on the servers, and ``iterations``.

    Parameters
    ----------
    transform : a transform of :mod:`daskps._core.transforms`
    lazy_sparse : bool
        With an ``IndexedSlices`` gradient, update only the rows it names
        (their slot rows too): the usual choice for embeddings, as
        TensorFlow Addons' ``LazyAdam``. ``False`` turns the gradient into a
        dense one (repeated rows summed) and updates every row, as Keras does.
        Weight decay follows the same choice: with ``lazy_sparse`` only the
        named rows decay.
    name : str
    clipnorm, clipvalue, global_clipnorm : float, optional
        Gradient clipping, at most one of them (as Keras): each gradient to
        an L2 norm of at most ``clipnorm``; each value to
        ``[-clipvalue, clipvalue]``; or all gradients of one
        :meth:`apply`/:meth:`apply_gradients` call together to a global norm
        of at most ``global_clipnorm``. Clipping runs on the trainer, before
        a gradient is split into shards, so norms are over whole variables.
        The norm of an ``IndexedSlices`` gradient is that of its values as
        given (repeated rows not summed first), as TensorFlow computes it.

    Create optimizers inside ``strategy.scope()``, so that ``iterations``
    lives on a parameter server and every trainer counts into it.
    """

    def __init__(self, transform: Any, lazy_sparse: bool = True, name: str = "Optimizer",
                 clipnorm: float | None = None, clipvalue: float | None = None,
                 global_clipnorm: float | None = None):
        if not isinstance(name, str):
            raise TypeError(f"name must be a string, got {type(name).__name__}")
        if not name:
            raise ValueError("name must be a non-empty string, got ''")
        lazy_sparse = check_flag(lazy_sparse, "lazy_sparse")
        given = {k: v for k, v in (("clipnorm", clipnorm), ("clipvalue", clipvalue),
                                   ("global_clipnorm", global_clipnorm)) if v is not None}
        if len(given) > 1:
            raise ValueError(f"only one of clipnorm, clipvalue and global_clipnorm can be set, got {given}")
        clip = clipping.Clipping(*(check_optional(v, a, allow_zero=False) for a, v in (
            ("clipnorm", clipnorm), ("clipvalue", clipvalue), ("global_clipnorm", global_clipnorm))))
        mode = context.current_mode()
        strategy: Any = mode.strategy
        in_scope = strategy.variable_creator is not None and mode.replica_context is None
        if in_scope and strategy.group is None:
            raise RuntimeError("create optimizers on the coordinator, not inside a scheduled function")
        self._transform = transform
        self._clipping = clip
        self._lazy_sparse = bool(lazy_sparse)
        self.name = name
        self.iterations = Variable(np.int64(0), trainable=False, name=f"{name}/iterations")
        owner = strategy.group if in_scope else None
        servers = list(strategy.servers) if in_scope else []
        self._key = f"{name}@{uuid.uuid4().hex[:12]}"  # names this optimizer on the servers
        servers.append(LOCAL)  # local variables can be trained too
        try:
            recipe = protocol.add_optimizer(servers, self._key, transform, self.lazy_sparse, name, owner)
        except BaseException:
            with contextlib.suppress(Exception):  # undo where it worked; the first error is the one to see
                protocol.release([(s, self._key) for s in servers], owner)
            raise
        self._refs = [refs.owned(s, self._key, f"<optimizer {name}>", owner) for s in servers]
        self._keep_recipe(recipe)
        self._built: list[Any] | None = None

    def __reduce__(self) -> Any:
        remote = [r for r in self._refs if not r.server.is_local]  # this process's own server stays here
        return (self._rebuilt, (type(self), self._transform, self.lazy_sparse, self.name, self.iterations,
                                self._key, remote, self._clipping))

    @staticmethod  # (a plain function: cloudpickle sends it by reference, as a module-level one)
    def _rebuilt(cls: type, transform: Any, lazy: bool, name: str, iterations: Variable, key: str, held: list,
                 clipping: Any) -> Optimizer:
        """The optimizer as a scheduled function captured it (on a trainer)."""
        opt: Optimizer = object.__new__(cls)
        opt._transform, opt._lazy_sparse, opt.name, opt.iterations = transform, lazy, name, iterations
        opt._key, opt._refs, opt._built, opt._clipping = key, held, None, clipping
        return opt

    @property
    def server_key(self) -> str:
        """The key that names this optimizer (its settings and slots) on the parameter servers."""
        return self._key

    @property
    def handles(self) -> tuple[Any, ...]:
        """This optimizer's handles, one per server it is configured on."""
        return tuple(self._refs)

    # -- hyperparameters --------------------------------------------------------
    @property
    def learning_rate(self) -> float:
        """The learning rate; with a schedule, its value at ``iterations`` (read from its server), as Keras.

        Setting it changes it on every server (one call each); slots are
        kept. A schedule may replace a number or a schedule; a number may not
        replace a schedule (Keras refuses that too).
        """
        rate = self._transform.learning_rate
        if isinstance(rate, schedules.LearningRateSchedule):
            return float(rate(int(self.iterations.numpy())))
        return rate

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        if isinstance(self._transform.learning_rate, schedules.LearningRateSchedule) and not isinstance(
                value, schedules.LearningRateSchedule):
            raise TypeError(
                f"optimizer {self.name!r} was made with a LearningRateSchedule as its learning_rate, so it "
                f"cannot be set to the number {value!r}; set another schedule, or make the optimizer with a number"
            )
        self._reconfigure(learning_rate=check_rate(value))

    @property
    def clipnorm(self) -> float | None:
        return self._clipping.clipnorm

    @property
    def lazy_sparse(self) -> bool:
        """Whether an ``IndexedSlices`` gradient updates only its rows; fixed when the optimizer is made.

        The servers take it at construction, so it cannot be assigned: make
        another optimizer for the other mode.
        """
        return self._lazy_sparse

    @lazy_sparse.setter
    def lazy_sparse(self, value: bool) -> None:
        raise AttributeError(
            f"lazy_sparse of optimizer {self.name!r} is fixed when it is made (the servers hold it): "
            f"make another optimizer with lazy_sparse={bool(value)}"
        )

    @property
    def clipvalue(self) -> float | None:
        return self._clipping.clipvalue

    @property
    def global_clipnorm(self) -> float | None:
        return self._clipping.global_clipnorm

    def exclude_from_weight_decay(self, var_list: Sequence[Any] | None = None,
                                  var_names: Sequence[str] | None = None) -> None:
        """Keep ``var_list`` and every variable whose name contains one of ``var_names`` from weight decay.

        As Keras' method of that name: ``var_names`` are regular expressions
        searched for in the variable's name (a shard's name starts with its
        variable's). A second call replaces the first. The choice is sent to
        every server (one call each).
        """
        keys = frozenset(ref.key for v in (var_list or []) for ref in _refs_of(v, "var_list"))
        for n in var_names or []:
            if not isinstance(n, str):
                raise TypeError(f"var_names must be strings, got {n!r}")
        pattern = "|".join(sorted(set(var_names))) if var_names else None
        self._reconfigure(decay_exempt=transforms.DecayExempt(keys, pattern) if keys or pattern else None)

    def _reconfigure(self, **changes: Any) -> None:
        transform = self._transform._replace(**changes)
        owner = next((r.owner for r in self._refs if r.owner is not None), None)
        recipe = protocol.reconfigure_optimizer([r.server for r in self._refs], self._key, transform,
                                                self.lazy_sparse, self.name, owner)
        self._transform = transform
        self._keep_recipe(recipe)

    def _keep_recipe(self, recipe: ops.AddOptimizer) -> None:
        """What a re-created server needs to configure this optimizer (see daskps.coordinator.recovery)."""
        for r in self._refs:
            r.recipe = recipe

    # -- the pure part ----------------------------------------------------------
    @property
    def transform(self) -> Any:
        """The pure transform the servers run for this optimizer (a :class:`daskps._core.transforms.Chain`
        for Keras' optimizers)."""
        return self._transform

    def init(self, param: np.ndarray) -> Any:
        """The state for ``param``: a NamedTuple of ``count`` and slot arrays."""
        return self._transform.init(param)

    def update(self, grad: np.ndarray, state: Any, param: np.ndarray) -> tuple[np.ndarray, Any]:
        """The step to add to ``param`` and the next state (pure: nothing is changed)."""
        return self._transform.update(grad, state, param)

    # -- Keras' API -------------------------------------------------------------
    def build(self, var_list: Sequence[Any]) -> None:
        """Remember ``var_list`` as the variables :meth:`apply` trains when given none."""
        self._built = [v for v in var_list]
        for v in self._built:
            if not isinstance(v, EmbeddingTable):
                shards_of(v, "var_list")

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]], name: Any = None) -> Variable:
        """Apply ``(gradient, variable)`` pairs: one call per parameter server, all at once.

        Gradients are arrays of the variable's shape or ``IndexedSlices`` of
        its rows; ``None`` gradients are skipped. Every gradient is checked
        before anything is sent, and each server checks again before
        applying. Returns ``iterations``, as Keras does.
        """
        if name is not None and not isinstance(name, str):
            raise TypeError(
                "apply_gradients takes one argument, a list of (gradient, variable) pairs; "
                "to pass gradients and variables as two lists, use optimizer.apply(grads, variables)"
            )
        pairs = []
        for i, pair in enumerate(grads_and_vars):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise TypeError(
                    f"grads_and_vars must be (gradient, variable) pairs; item {i} is "
                    f"{_describe(pair)}. To pass gradients and variables as two lists, use "
                    "optimizer.apply(grads, variables)"
                )
            pairs.append(pair)
        self._apply([as_gradient(g) for g, _ in pairs], [v for _, v in pairs])
        return self.iterations

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        """Apply ``grads`` to ``trainable_variables`` (Keras 3's ``apply``), leaf by leaf.

        Both may be lists, or trees of the same structure (as
        :func:`daskps.create_variables` makes: a JAX pytree, nested dicts...),
        matched by path; a structure mismatch names the first differing path.
        Gradient leaves are numpy arrays, anything with ``__array__`` or
        ``__dlpack__`` (JAX arrays, torch tensors), ``IndexedSlices``, or
        ``None`` (that variable is skipped). Without ``trainable_variables``,
        the variables given to :meth:`build`.
        """
        if trainable_variables is None:
            if self._built is None:
                raise ValueError("trainable_variables must be given, or the optimizer built first with build(var_list)")
            trainable_variables = self._built
        var_paths, variables, _ = trees.flatten(trainable_variables)
        grad_paths, flat_grads, _ = trees.flatten(grads, is_leaf=lambda g: isinstance(g, IndexedSlices))
        if _flat_sequence(grads) and _flat_sequence(trainable_variables) and len(flat_grads) != len(variables):
            raise ValueError(
                f"grads and trainable_variables must have the same length, got {len(flat_grads)} gradients "
                f"for {len(variables)} variables"
            )
        order = trees.match(var_paths, grad_paths, "grads", "trainable_variables")
        pairs = []
        for path, i, v in zip(var_paths, order, variables):
            g = flat_grads[i]
            if isinstance(v, (Variable, ShardedVariable, EmbeddingTable)):
                pairs.append((g, v))
            elif trees.is_array(g) or isinstance(g, (IndexedSlices, PooledSlices)):
                raise TypeError(f"trainable_variables at {trees.describe(path)} must be a Variable to take a "
                                f"gradient, got {_describe(v)}")
            # A tree's other leaves (a dataclass's activation name, None) carry no gradient.
        self._apply([as_gradient(g) for g, _ in pairs], [v for _, v in pairs])

    def _apply(self, grads: list[Any], variables: list[Any]) -> None:
        checked: list[tuple[Any, str, Any]] = []
        for grad, var in zip(grads, variables):
            if grad is None:
                continue
            if isinstance(grad, PooledSlices):
                checked.append((var, "bags", self._pooled(var, grad)))
                continue
            if isinstance(var, EmbeddingTable):
                checked.append((var, "rows", _table_gradient(var, grad)))
                continue
            if not isinstance(var, (Variable, ShardedVariable)):
                raise TypeError(f"gradients must be paired with Variables, got {_describe(var)}")
            transforms.check_trainable(var.dtype, var.name, self.name)
            checked.append((var, *check_gradient(var.shape, var.dtype, var.name, grad)))
        # Clipping sees whole gradients: the servers see only their shards' parts.
        clipped = clipping.clip_gradients(self._clipping, [(kind, payload) for _, kind, payload in checked])
        items: list[tuple[Any, str, Any]] = []
        for (var, _, _), (kind, payload) in zip(checked, clipped):
            items.extend(_split_gradient(var, kind, payload))
        counter = self.iterations.handle
        if counter.server.is_local and any(not h.server.is_local for h, _, _ in items):
            raise RuntimeError(
                f"optimizer {self.name!r} was created outside strategy.scope(), so its iterations "
                "counter is not on a parameter server; create it inside the scope"
            )
        protocol.apply_gradients(self._key, items, counter, transforms.additive(self._transform))

    def _pooled(self, var: Any, grad: PooledSlices) -> Any:
        """A pooled gradient checked for ``var``: ``(bag weights' squared sums, values / divisor, bags)``."""
        if not isinstance(var, (Variable, ShardedVariable, EmbeddingTable)):
            raise TypeError(f"a PooledSlices gradient must be paired with a Variable, ShardedVariable or "
                            f"EmbeddingTable, got {_describe(var)}")
        transforms.check_trainable(var.dtype, var.name, self.name)
        if self._clipping.clipvalue is not None and grad.bags.weights is not None:
            raise ValueError(f"optimizer {self.name!r} clips each value (clipvalue), which a weighted PooledSlices "
                             "gradient cannot do per id; use clipnorm or global_clipnorm, or an IndexedSlices "
                             "gradient (PooledSlices.to_indexed_slices())")
        values, squares = check_pooled(var, grad)
        return clipping.Pooled(squares, values, grad.bags)

    def __repr__(self) -> str:
        rate = self._transform.learning_rate  # a schedule as itself: no call to a server
        return f"<daskps.optimizers.{type(self).__name__} {self.name!r} learning_rate={rate}>"


def _refs_of(var: Any, arg: str) -> list[Any]:
    return [v.handle for v in shards_of(var, arg)]


def as_gradient(grad: Any) -> Any:
    """A gradient as numpy: JAX arrays, torch tensors and other array types converted; ``None`` kept."""
    if grad is None or isinstance(grad, np.ndarray):
        return grad
    if isinstance(grad, IndexedSlices):
        if isinstance(grad.values, np.ndarray) and isinstance(grad.indices, np.ndarray):
            return grad
        return IndexedSlices(trees.to_numpy(grad.values), trees.to_numpy(grad.indices), grad.dense_shape)
    return trees.to_numpy(grad) if trees.is_array(grad) else grad


def _flat_sequence(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and not hasattr(x, "_fields") and all(
        trees.is_array(v) or v is None or isinstance(v, IndexedSlices) for v in x)


def _describe(x: Any) -> str:
    shape = getattr(x, "shape", None)
    return f"a {type(x).__name__}" + (f" of shape {shape}" if shape is not None else "")


def _table_gradient(table: EmbeddingTable, grad: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, values)`` of an embedding table's gradient, checked."""
    if not isinstance(grad, IndexedSlices):
        raise TypeError(f"the gradient for embedding table {table.name!r} must be IndexedSlices(values, keys), "
                        f"got {_describe(grad)}")
    keys = table.keys_of(grad.indices, "gradient keys", one_d=True)
    values = coerce_values(grad.values, table.dtype, table.name, "gradient values")
    if values.shape != (len(keys), table.dim):
        raise ValueError(f"gradient values for embedding table {table.name!r} must have shape "
                         f"{(len(keys), table.dim)}, got {values.shape}")
    return keys, values


def _split_gradient(var: Any, kind: str, payload: Any) -> list[tuple[Any, str, Any]]:
    """``(handle, kind, payload)`` for each shard (or part) of ``var``."""
    if kind == "bags":
        return payload.bags.gradient_parts(var, payload.values)
    if isinstance(var, EmbeddingTable):
        # Repeated keys summed here (each part gets distinct keys, in order: as its lookups send them);
        # every part gets its part, even an empty one: all parts count the same steps.
        keys, values = transforms.sum_rows(*payload)
        return [(h, "rows", (keys[w], values[w])) for h, w in zip(var.handles, var.split(keys))]
    if isinstance(var, Variable):
        return [(var.handle, kind, payload)]
    if kind == "dense":
        laid = var.in_shard_order(payload)
        return [(v.handle, "dense", laid[a:b]) for v, a, b in zip(var.variables, var.row_offsets, var.row_offsets[1:])]
    # Every shard gets its part, even an empty one, so that all shards count the same
    # steps and Adam's bias correction does not depend on the sharding.
    idx, values = payload
    parts = rows.split_rows(var.row_offsets, var.physical(idx), values)
    return [(v.handle, "rows", part) for v, part in zip(var.variables, parts)]
