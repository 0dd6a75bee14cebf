"""Optimizers that run on the parameter servers, beside the variables.

Each optimizer wraps a pure transform from :mod:`daskps._core.transforms`
(optax's style: ``init(param) -> state`` and ``update(grad, state, param) ->
(updates, state)``, with state a typed ``NamedTuple``). The transform is sent
to every parameter server once, when the optimizer is made; after that a
step names the optimizer by key. ``apply_gradients`` groups the gradients
by server and sends each server one call; the server keeps the state next
to the variable (or shard) and applies the update there. ``iterations``
lives on a server too and is bumped within one of those calls.

The arithmetic is Keras 3's for optimizers of the same name and arguments.

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

from daskps._core import transforms, trees
from daskps._core.slices import IndexedSlices
from daskps._core.updates import check_gradient
from daskps.distribute import context
from daskps.ps import protocol, refs
from daskps.variables import rows
from daskps.variables.variable import ShardedVariable, Variable, shards_of

__all__ = ["SGD", "Adagrad", "Adam", "Optimizer"]


def _positive(value: Any, arg: str, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{arg} must be a {'non-negative' if allow_zero else 'positive'} number, got {value!r}")
    return float(value)


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
    name : str

    Create optimizers inside ``strategy.scope()``, so that ``iterations``
    lives on a parameter server and every trainer counts into it.
    """

    def __init__(self, transform: Any, lazy_sparse: bool = True, name: str = "Optimizer"):
        mode = context.current_mode()
        strategy: Any = mode.strategy
        in_scope = getattr(strategy, "_variable_creator", None) is not None and mode.replica_context is None
        if in_scope and getattr(strategy, "_group", None) is None:
            raise RuntimeError("create optimizers on the coordinator, not inside a scheduled function")
        self._transform = transform
        self.lazy_sparse = bool(lazy_sparse)
        self.name = name
        self.iterations = Variable(np.int64(0), trainable=False, name=f"{name}/iterations")
        owner = getattr(strategy, "_group", None) if in_scope else None
        servers = list(strategy._ps) if in_scope else []
        self._key = f"{name}@{uuid.uuid4().hex[:12]}"  # names this optimizer on the servers
        servers.append(protocol.LOCAL)  # local variables can be trained too
        try:
            protocol.add_optimizer(servers, self._key, transform, self.lazy_sparse, name, owner)
        except BaseException:
            with contextlib.suppress(Exception):  # undo where it worked; the first error is the one to see
                protocol.release([(s, self._key) for s in servers], owner)
            raise
        self._refs = [refs.owned(s, self._key, f"<optimizer {name}>", owner) for s in servers]
        self._keep_recipe()
        self._built: list[Any] | None = None

    def __reduce__(self) -> Any:
        remote = [r for r in self._refs if not r.server.is_local]  # this process's own server stays here
        return (_rebuild, (type(self), self._transform, self.lazy_sparse, self.name, self.iterations,
                           self._key, remote))

    # -- hyperparameters --------------------------------------------------------
    @property
    def learning_rate(self) -> float:
        return self._transform.learning_rate

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        """Change the learning rate on every server (one call each); slots are kept."""
        self._reconfigure(learning_rate=_positive(value, "learning_rate"))

    def _reconfigure(self, **changes: Any) -> None:
        transform = self._transform._replace(**changes)
        owner = next((r.owner for r in self._refs if r.owner is not None), None)
        protocol.add_optimizer([r.server for r in self._refs], self._key, transform, self.lazy_sparse,
                               self.name, owner, new=False)
        self._transform = transform
        self._keep_recipe()

    def _keep_recipe(self) -> None:
        """What a re-created server needs to configure this optimizer (see daskps.coordinator.recovery)."""
        for r in self._refs:
            r.recipe = ("optimizer", self._transform, self.lazy_sparse, self.name)

    def __getattr__(self, name: str) -> Any:
        transform = self.__dict__.get("_transform")
        if transform is not None and name in transform._fields:
            return getattr(transform, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- the pure part ----------------------------------------------------------
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
        pairs = [(flat_grads[i], v) for i, v in zip(order, variables)]
        # A tree's other leaves (a dataclass's activation name, None) carry no gradient.
        pairs = [(g, v) for g, v in pairs if isinstance(v, (Variable, ShardedVariable)) or trees.is_array(g)
                 or isinstance(g, IndexedSlices)]
        self._apply([as_gradient(g) for g, _ in pairs], [v for _, v in pairs])

    def _apply(self, grads: list[Any], variables: list[Any]) -> None:
        items: list[tuple[Any, str, Any]] = []
        for grad, var in zip(grads, variables):
            if grad is None:
                continue
            if not isinstance(var, (Variable, ShardedVariable)):
                raise TypeError(f"gradients must be paired with Variables, got {_describe(var)}")
            transforms.check_trainable(var.dtype, var.name, self.name)
            items.extend(_split_gradient(var, grad))
        counter = self.iterations._ref
        if counter.server.is_local and any(not v._ref.server.is_local for v, _, _ in items):
            raise RuntimeError(
                f"optimizer {self.name!r} was created outside strategy.scope(), so its iterations "
                "counter is not on a parameter server; create it inside the scope"
            )
        protocol.apply_gradients(self._key, [(v._ref, kind, g) for v, kind, g in items], counter)

    def __repr__(self) -> str:
        return f"<daskps.optimizers.{type(self).__name__} {self.name!r} learning_rate={self.learning_rate}>"


def _rebuild(cls: type, transform: Any, lazy: bool, name: str, iterations: Variable, key: str, held: list) -> Optimizer:
    opt: Optimizer = object.__new__(cls)
    opt._transform, opt.lazy_sparse, opt.name, opt.iterations = transform, lazy, name, iterations
    opt._key, opt._refs, opt._built = key, held, None
    return opt


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


def _split_gradient(var: Any, grad: Any) -> list[tuple[Variable, str, Any]]:
    kind, payload = check_gradient(var.shape, var.dtype, var.name, grad)
    if isinstance(var, Variable):
        return [(var, kind, payload)]
    if kind == "dense":
        return [(v, "dense", payload[a:b]) for v, a, b in var._spans()]
    # Every shard gets its part, even an empty one, so that all shards count the
    # same steps and Adam's bias correction does not depend on the sharding.
    return list(zip(var.variables, ["rows"] * len(var.variables), rows.split_rows(var._offsets, *payload)))


class SGD(Optimizer):
    """Gradient descent, with optional (Nesterov) momentum, as ``keras.optimizers.SGD``.

    >>> opt = SGD(0.1, momentum=0.9)
    >>> updates, state = opt.update(np.ones(2, np.float32), opt.init(np.zeros(2, np.float32)), np.zeros(2, np.float32))
    >>> updates, state.momentum
    (array([-0.1, -0.1], dtype=float32), array([-0.1, -0.1], dtype=float32))
    """

    def __init__(self, learning_rate: float = 0.01, momentum: float = 0.0, nesterov: bool = False,
                 lazy_sparse: bool = True, name: str = "SGD"):
        momentum = _positive(momentum, "momentum", allow_zero=True)
        if momentum > 1:
            raise ValueError(f"momentum must be in [0, 1], got {momentum!r}")
        transform = transforms.SGDTransform(_positive(learning_rate, "learning_rate"), momentum, bool(nesterov))
        super().__init__(transform, lazy_sparse, name)


class Adagrad(Optimizer):
    """Adagrad, as ``keras.optimizers.Adagrad``: ``p -= lr * g / sqrt(acc + epsilon)``."""

    def __init__(self, learning_rate: float = 0.001, initial_accumulator_value: float = 0.1,
                 epsilon: float = 1e-7, lazy_sparse: bool = True, name: str = "Adagrad"):
        transform = transforms.AdagradTransform(
            _positive(learning_rate, "learning_rate"),
            _positive(initial_accumulator_value, "initial_accumulator_value", True),
            _positive(epsilon, "epsilon"),
        )
        super().__init__(transform, lazy_sparse, name)


class Adam(Optimizer):
    """Adam, as ``keras.optimizers.Adam`` (``amsgrad`` included).

    The bias correction uses the number of updates the variable has had,
    which equals Keras' ``iterations + 1`` when every step updates it.
    """

    def __init__(self, learning_rate: float = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, amsgrad: bool = False, lazy_sparse: bool = True, name: str = "Adam"):
        for arg, value in (("beta_1", beta_1), ("beta_2", beta_2)):
            if not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"{arg} must be in [0, 1), got {value!r}")
        transform = transforms.AdamTransform(_positive(learning_rate, "learning_rate"), float(beta_1),
                                             float(beta_2), _positive(epsilon, "epsilon"), bool(amsgrad))
        super().__init__(transform, lazy_sparse, name)
