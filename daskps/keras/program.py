"""What a trainer runs for ``dps.keras``: the model's own steps, built once per trainer process.

The model travels to each trainer once (pickled by Keras itself, fetched
through a per-worker dataset the way ``create_per_worker_dataset`` fetches a
``dataset_fn``) and is compiled there: Keras' loss, ``compute_loss``,
compiled metrics, ``sample_weight`` and non-trainable state (moving
statistics, the dropout seed stream), all inside one jitted function per
kind of step. A step reads every variable from the servers (one round trip
per server), runs that function, pushes the gradients to the optimizer on
the servers and the change of each non-trainable variable as an
``assign_add`` (as TensorFlow's moving averages do, so concurrent trainers'
changes add up), and returns the change of the metrics' state, which the
coordinator adds up in order.
"""

from __future__ import annotations

import collections
import contextlib
import pickle
import threading
import warnings
from typing import Any, NamedTuple

import numpy as np

from daskps._core.slices import IndexedSlices
from daskps.keras.backend import build_from, check_backend
from daskps.variables.bags import PooledSlices
from daskps.variables.variable import read_values

__all__ = ["ModelBlob", "PredictStep", "StepResult", "TestStep", "TrainStep", "check_backend", "predict_block", "program",
           "programs_with_train_step"]

# Programs built in this process, by the id of the binding that made them (newest last).
_PROGRAMS: collections.OrderedDict[str, Any] = collections.OrderedDict()
_PROGRAMS_LOCK = threading.Lock()
MAX_PROGRAMS = 4


class ModelBlob(NamedTuple):
    """The model as Keras pickles it, with the backend it was built for and what the coordinator saw."""

    program_id: str
    backend: str
    model: bytes
    metric_shapes: tuple[tuple[int, ...], ...]
    tables: tuple[str, ...] = ()  # the names of the model's EmbeddingTable layers


class StepResult(NamedTuple):
    """What a train or test step sends back: the change of the metrics' state, and, while the coordinator
    has not seen a batch (a ``dataset_fn`` input), two rows of one, for Keras to build its metrics."""

    metrics: list[np.ndarray]
    sample: Any = None


def _plain(delta: list[np.ndarray]) -> list[Any]:
    """Scalars as Python numbers: a report with numpy arrays in it travels through the scheduler much slower."""
    return [d.item() if d.ndim == 0 else d for d in delta]


def _added(total: list[np.ndarray] | None, metrics: list[Any], start: list[np.ndarray]) -> list[np.ndarray]:
    """``total`` plus one batch's change of the metrics' state (from Keras' reset values ``start``)."""
    delta = [np.asarray(m) - s for m, s in zip(metrics, start)]
    return delta if total is None else [t + d for t, d in zip(total, delta)]


def _result(prog: Any, total: list[np.ndarray] | None, batches: list[Any]) -> StepResult:
    """A step's answer; two rows of a batch while the coordinator has not built its metrics."""
    return StepResult(_plain(total or []), None if prog.blob.metric_shapes or not batches else _sample(batches[0]))


def _sample(batch: Any) -> Any:
    import keras

    return keras.tree.map_structure(lambda a: None if a is None else np.asarray(a)[:2], batch)


class _Program:
    """A trainer's copy of the model and its jitted train, test and predict functions."""

    def __init__(self, blob: ModelBlob):
        check_backend(blob.backend)
        import jax

        if blob.tables:
            import daskps.keras.layers  # noqa: F401  (registers the layer class before Keras rebuilds the model)
        with warnings.catch_warnings():  # Keras warns that the unbuilt optimizer's slots are not loaded: none are
            warnings.simplefilter("ignore", UserWarning)
            self.model = pickle.loads(blob.model)
        self.model.reset_metrics()
        self.built = False
        self.blob = blob
        self._jax = jax
        self._train: Any = None
        self._test: Any = None
        self._predict: Any = None
        self._ids: Any = None

    def build(self, batch: Any) -> None:
        """Build the compiled metrics (Keras makes them at the first batch) and check they match the coordinator's."""
        if self.built:
            return
        build_from(self.model, batch)  # Keras' own build of metrics and optimizer
        shapes = tuple(tuple(v.shape) for v in self.model.metrics_variables)
        if self.blob.metric_shapes and shapes != self.blob.metric_shapes:
            raise RuntimeError(f"the model rebuilt on this trainer has metric variables of shapes {shapes}, "
                               f"the coordinator's has {self.blob.metric_shapes}")
        self.metrics_start = [np.asarray(v.value) for v in self.model.metrics_variables]
        self.built = True

    @property
    def has_train_step(self) -> bool:
        return self._train is not None

    def train_fn(self) -> Any:
        if self._train is None:
            model, jax = self.model, self._jax
            optimizer_values = [v.value for v in model.optimizer.variables]

            def step(trainable: Any, rows: Any, non_trainable: Any, metrics: Any, data: Any) -> Any:
                from keras.src.trainers.data_adapters import data_adapter_utils

                x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)

                def loss(trainable: Any, rows: Any) -> Any:
                    with _rows(rows):
                        return model.compute_loss_and_updates(trainable, non_trainable, metrics, x, y, sample_weight,
                                                              training=True, optimizer_variables=optimizer_values)

                (_, aux), (grads, row_grads) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(trainable, rows)
                unscaled, y_pred, new_non_trainable, new_metrics = aux
                _, new_metrics = model._update_metrics_variables(new_metrics, unscaled, x, y, y_pred, sample_weight)
                return grads, row_grads, new_non_trainable, new_metrics

            self._train = jax.jit(step)
        return self._train

    def test_fn(self) -> Any:
        if self._test is None:
            def step(state: Any, data: Any, rows: Any) -> Any:
                with _rows(rows):
                    return self.model.test_step(state, data)  # stateless on JAX: Keras' own

            self._test = self._jax.jit(step)
        return self._test

    def predict_fn(self) -> Any:
        if self._predict is None:
            def step(state: Any, data: Any, rows: Any) -> Any:
                with _rows(rows):
                    return self.model.predict_step(state, data)

            self._predict = self._jax.jit(step)
        return self._predict

    def table_ids(self, batch: Any) -> dict[str, np.ndarray]:
        """The ids each ``EmbeddingTable`` layer sees for ``batch`` (none without such layers)."""
        if not self.blob.tables:
            return {}
        if self._ids is None:
            from daskps.keras.layers import recording_ids

            model, jax = self.model, self._jax
            own = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables])

            def record(x: Any) -> Any:
                found: dict[str, Any] = {}
                with recording_ids(found):
                    model.stateless_call(*own, x)
                return found

            self._ids = jax.jit(record)
        from keras.src.trainers.data_adapters import data_adapter_utils

        x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(batch)
        return {k: np.asarray(v).astype(np.int64) for k, v in self._ids(x).items()}

    # -- what the steps call, the same for every backend ---------------------------------------
    def train(self, trainable: list[Any], non_trainable: list[Any], batch: Any,
              rows: dict[str, Any] | None = None) -> tuple[list, dict, list, list]:
        """Gradients (of the variables, and of the tables' rows), the non-trainable variables' new values and
        the metrics' state after one batch."""
        grads, row_grads, new_non_trainable, metrics = self.train_fn()(trainable, rows or {}, non_trainable,
                                                                       self.metrics_start, batch)
        return list(grads), dict(row_grads), list(new_non_trainable), list(metrics)

    def test(self, trainable: list[Any], non_trainable: list[Any], batch: Any,
             rows: dict[str, Any] | None = None) -> list[Any]:
        _, (_, _, metrics) = self.test_fn()((trainable, non_trainable, self.metrics_start), batch, rows or {})
        return list(metrics)

    def predict(self, trainable: list[Any], non_trainable: list[Any], batch: Any,
                rows: dict[str, Any] | None = None) -> Any:
        return self.predict_fn()((trainable, non_trainable), batch, rows or {})[0]


def _rows(rows: dict[str, Any]) -> Any:
    """The tables' rows as the layers' outputs while Keras' step is traced (nothing to do without tables)."""
    if not rows:
        return contextlib.nullcontext()
    from daskps.keras.layers import using_rows

    return using_rows(rows)


def programs_with_train_step() -> int:
    """How many programs in this process have compiled their training step (benchmarks warm up with it)."""
    with _PROGRAMS_LOCK:
        return sum(1 for p in _PROGRAMS.values() if p.has_train_step)


def program(blob: ModelBlob) -> Any:
    """This process's program for ``blob`` (built at its first use, then kept)."""
    with _PROGRAMS_LOCK:
        found = _PROGRAMS.get(blob.program_id)
        if found is None:
            if blob.backend == "torch":
                from daskps.keras.torch_program import TorchProgram

                found = _PROGRAMS[blob.program_id] = TorchProgram(blob)
            else:
                found = _PROGRAMS[blob.program_id] = _Program(blob)
            while len(_PROGRAMS) > MAX_PROGRAMS:
                _PROGRAMS.popitem(last=False)
        return found


class _Pooled(NamedTuple):
    """A pooling layer's bags, and the shape of its output less the row (its ids' shape less the last axis)."""

    bags: Any
    shape: tuple[int, ...]


class _Step:
    """Fields every kind of step carries: the model's variables and hash tables on the servers (small handles)."""

    def __init__(self, trainable: list[Any], non_trainable: list[Any], tables: dict[str, Any] | None = None,
                 pooling: dict[str, str] | None = None):
        self.trainable = list(trainable)
        self.non_trainable = list(non_trainable)
        self.tables = dict(tables or {})
        self.pooling = dict(pooling or {})  # layer name -> combiner, for the layers that pool their ids

    def lookups(self, ids: dict[str, np.ndarray]) -> dict[str, Any]:
        """What to read for each table layer: its ids, or (a pooling layer) its rows of ids as bags."""
        from daskps.variables.bags import Bags

        out: dict[str, Any] = {}
        for name, found in ids.items():
            combiner = self.pooling.get(name)
            if combiner is None:
                out[name] = found
            else:  # a bag per row of ids (the last axis); ids < 0 (padding) are dropped
                bags = int(np.prod(found.shape[:-1]))
                out[name] = _Pooled(Bags((found.reshape(-1), np.full(bags, found.shape[-1])), combiner=combiner),
                                    tuple(found.shape[:-1]))
        return out

    def values(self, ids: dict[str, np.ndarray] | None = None,
               lookups: dict[str, Any] | None = None) -> tuple[list[np.ndarray], list[np.ndarray], dict]:
        """The variables' values and the tables' rows (or pooled vectors) for ``ids``, in one round trip per server."""
        lookups = self.lookups(ids or {}) if lookups is None else lookups
        names = sorted(lookups)
        wanted = [getattr(lookups[n], "bags", lookups[n]) for n in names]
        values = read_values(self.trainable + self.non_trainable + [(self.tables[n], w) for n, w in zip(names, wanted)])
        k, m = len(self.trainable), len(self.trainable) + len(self.non_trainable)
        rows = {n: v.reshape(lookups[n].shape + v.shape[1:]) if n in self.pooling else v
                for n, v in zip(names, values[m:])}
        return values[:k], values[k:m], rows


def _batches(data_iterator: Any, payloads: Any) -> list[Any]:
    """The batches of one step: rows of the arrays sent once, or the next elements of a dataset_fn's iterator."""
    if isinstance(payloads, int):
        return [next(data_iterator) for _ in range(payloads)]
    if hasattr(payloads, "convert"):  # batches drawn from a Dask collection's queue
        return [payloads.convert(next(data_iterator)) for _ in range(payloads.batches)]
    source = next(data_iterator)
    return [source.batch(p) for p in payloads]


def _rows_of(grad: Any) -> Any:
    """An embedding matrix's gradient as the rows it touches (Keras' dense gradient is zero elsewhere)."""
    grad = np.asarray(grad)
    rows = np.flatnonzero(np.any(grad != 0, axis=tuple(range(1, grad.ndim))))
    return IndexedSlices(grad[rows], rows, dense_shape=grad.shape)


class TrainStep(_Step):
    """``steps_per_execution`` training steps on one trainer; returns the change of the metrics' state.

    ``row_wise`` are the positions of embedding matrices among the trainable
    variables: their gradients travel as the rows the batch touched
    (``IndexedSlices``), not the whole matrix; the optimizer on the servers
    applies them as Keras applies the dense gradient.
    """

    def __init__(self, trainable: list[Any], non_trainable: list[Any], optimizer: Any,
                 row_wise: tuple[int, ...] = (), tables: dict[str, Any] | None = None,
                 pooling: dict[str, str] | None = None):
        super().__init__(trainable, non_trainable, tables, pooling)
        self.optimizer = optimizer
        self.row_wise = row_wise

    def __call__(self, model_iterator: Any, data_iterator: Any, payloads: Any) -> StepResult:
        prog = program(next(model_iterator))
        total: list[np.ndarray] | None = None
        batches = _batches(data_iterator, payloads)
        for batch in batches:
            prog.build(batch)
            lookups = self.lookups(prog.table_ids(batch))
            trainable, non_trainable, rows = self.values(lookups=lookups)
            grads, row_grads, new_non_trainable, metrics = prog.train(trainable, non_trainable, batch, rows)
            for i in self.row_wise:
                grads[i] = _rows_of(grads[i])
            names = sorted(row_grads)
            table_grads = [PooledSlices(np.asarray(row_grads[n]).reshape(lookups[n].bags.num_bags, rows[n].shape[-1]),
                                        lookups[n].bags) if n in self.pooling else
                           IndexedSlices(np.asarray(row_grads[n]).reshape(-1, rows[n].shape[-1]), lookups[n].ravel())
                           for n in names]
            self.optimizer.apply(grads + table_grads, self.trainable + [self.tables[n] for n in names])
            for var, old, new in zip(self.non_trainable, non_trainable, new_non_trainable):
                new = np.asarray(new)
                if not np.array_equal(new, old):
                    var.assign_add(new - old)
            total = _added(total, metrics, prog.metrics_start)
        return _result(prog, total, batches)


class TestStep(_Step):
    """Keras' ``test_step`` on ``steps_per_execution`` batches with the servers' weights; the metrics' change."""

    def __call__(self, model_iterator: Any, data_iterator: Any, payloads: Any) -> StepResult:
        prog = program(next(model_iterator))
        total: list[np.ndarray] | None = None
        batches = _batches(data_iterator, payloads)
        weights = None
        for batch in batches:
            prog.build(batch)
            ids = prog.table_ids(batch)
            if weights is None or ids:  # evaluation changes no weights: one read serves every batch, rows aside
                weights = self.values(ids)
            metrics = prog.test(weights[0], weights[1], batch, weights[2])
            total = _added(total, metrics, prog.metrics_start)
        return _result(prog, total, batches)


class PredictStep(_Step):
    """Keras' ``predict_step`` on a few batches with the servers' weights; the outputs as numpy."""

    def __call__(self, model_iterator: Any, data_iterator: Any, payloads: Any) -> list[Any]:
        import keras

        prog = program(next(model_iterator))
        outputs = []
        weights = None
        for batch in _batches(data_iterator, payloads):
            ids = prog.table_ids(batch)
            if weights is None or ids:
                weights = self.values(ids)
            out = prog.predict(weights[0], weights[1], batch, weights[2])
            outputs.append(keras.tree.map_structure(np.asarray, out))
        return outputs


def predict_block(block: np.ndarray, blob: ModelBlob, trainable: list[Any], non_trainable: list[Any],
                  batch_size: int, tables: dict[str, Any] | None = None,
                  empty: np.ndarray | None = None, pooling: dict[str, str] | None = None) -> np.ndarray:
    """One partition's predictions, on the trainer computing it, with the servers' weights (read once)."""
    prog = program(blob)
    step = _Step(trainable, non_trainable, tables, pooling)
    weights = None
    parts = []
    for i in range(0, len(block), batch_size):
        batch = (block[i:i + batch_size],)
        ids = prog.table_ids(batch)
        if weights is None or ids:
            weights = step.values(ids)
        parts.append(np.asarray(prog.predict(weights[0], weights[1], batch, weights[2])))
    return np.concatenate(parts) if parts else (empty if empty is not None else np.empty((0,), np.float32))
