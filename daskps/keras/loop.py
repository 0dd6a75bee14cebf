"""``fit``, ``evaluate`` and ``predict`` on the coordinator: Keras' loops, with each step run on a trainer.

The loop is Keras' own (``keras/src/backend/jax/trainer.py``): the same
``CallbackList`` and call order, the same epoch logs (the local model's
metrics hold the state the trainers' steps added up, and Keras computes
``result()`` from it), validation through ``on_test_*`` with ``val_``
names. What differs is where a step runs: ``schedule`` sends it to some
trainer, up to a window of steps ahead, and ``on_train_batch_end`` is
called for each step in order as its result comes back.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from daskps.coordinator.coordinator import ClusterCoordinator
from daskps.distribute import context
from daskps.distribute.strategy import ParameterServerStrategy
from daskps.keras.backend import build_from
from daskps.keras.binding import Binding, binding_for
from daskps.keras.data import Plan, Repeat, Step, as_source, is_dataset_fn, validation_parts

__all__ = ["evaluate", "fit", "predict"]

# Steps scheduled ahead of the one whose result the loop waits for, per trainer. The loop tops the window
# up once half of it has come back, so that the coordinator packs many steps into each Dask task (one
# schedule() at a time would make a task of each).
STEPS_AHEAD_PER_TRAINER = 64
# How often batch logs are worked out for the progress bar alone (seconds).
PROGBAR_INTERVAL = 0.1


def resolve_coordinator(coordinator: Any) -> ClusterCoordinator:
    if coordinator is not None:
        if not isinstance(coordinator, ClusterCoordinator):
            raise TypeError(f"coordinator must be a dps.ClusterCoordinator or None, got {type(coordinator).__name__}")
        return coordinator
    strategy = context.get_strategy()
    if isinstance(strategy, ParameterServerStrategy):
        return ClusterCoordinator(strategy)
    last = ParameterServerStrategy.last_scoped()  # where the model was built and compiled, as a script has it
    if last is not None:
        return ClusterCoordinator(last)
    found = ParameterServerStrategy.open_strategies()
    if len(found) == 1:
        return ClusterCoordinator(found[0])
    raise ValueError(
        f"no coordinator: this process has {len(found)} open ParameterServerStrategy objects, none whose "
        "scope() is entered or was entered last; pass coordinator=dps.ClusterCoordinator(strategy), or "
        "build the model and call dps.keras inside `with strategy.scope():`"
    )


def check_model(model: Any, what: str) -> None:
    import keras

    if not isinstance(model, keras.Model):
        raise TypeError(f"model must be a keras.Model, got {type(model).__name__}")
    if what != "predict" and not model.compiled:
        raise ValueError(f"model must be compiled before dps.keras.{what}: call model.compile(optimizer=..., "
                         "loss=..., metrics=...) first (inside strategy.scope() or not)")
    backend = keras.backend.backend()
    if backend not in ("jax", "torch"):
        raise ValueError(
            f"dps.keras runs Keras' JAX and PyTorch backends; this process runs Keras on {backend!r}: set "
            "KERAS_BACKEND=jax (or torch) before Keras is first imported (and in the workers' environment)"
        )
    overridden = [name for name in ("train_step", "test_step") if backend == "jax"
                  and getattr(type(model), name) is not getattr(keras.Model, name)]
    if overridden and what != "predict":
        raise ValueError(
            f"model overrides {overridden[0]}: on Keras' JAX backend dps.keras runs Keras' own step (split so that "
            "the servers apply the gradients) and would ignore it; use the PyTorch backend, or dps.ClusterCoordinator"
            " with a step of your own"
        )
    if not model.built:
        raise ValueError(f"model must be built before dps.keras.{what}: give it an Input, or call it on a batch "
                         "(its variables are what the parameter servers hold)")


def _positive(value: Any, arg: str, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < (0 if allow_zero else 1):
        raise ValueError(f"{arg} must be a {'non-negative' if allow_zero else 'positive'} integer, got {value!r}")
    return int(value)


class MetricsState:
    """The metrics' state on the coordinator: Keras' reset values plus every step's change, in order."""

    def __init__(self, model: Any):
        model.reset_metrics()
        self.model = model
        self.state = [np.array(v.numpy()) for v in model.metrics_variables]

    def add(self, result: Any) -> None:
        delta = result.metrics
        if result.sample is not None and not all(getattr(m, "built", True) for m in self.model.metrics):
            # A dataset_fn's first batch: Keras builds the compiled metrics from it, as at its own first batch.
            build_from(self.model, result.sample)
            self.model.reset_metrics()
            self.state = [np.array(v.numpy()) for v in self.model.metrics_variables]
        if len(delta) != len(self.state):
            raise RuntimeError(f"a trainer's step gave {len(delta)} metric variables, the model has {len(self.state)}")
        for s, d in zip(self.state, delta):
            s += np.asarray(d, dtype=s.dtype)

    def logs(self) -> dict[str, Any]:
        """Keras' logs for the state so far: the local metrics are given it, and ``result()`` does the rest."""
        from keras.src.utils.python_utils import pythonify_logs

        for var, value in zip(self.model.metrics_variables, self.state):
            var.assign(value)
        return pythonify_logs(self.model.get_metrics_result())


def _batch_logs_wanted(callbacks: Any, hook: str) -> tuple[bool, bool]:
    """Whether some callback reads batch logs at every batch, and whether a progress bar shows them."""
    import keras
    from keras.src import utils

    every, bar = False, False
    for cb in callbacks.callbacks:
        if isinstance(cb, keras.callbacks.ProgbarLogger):
            bar = True
        elif not isinstance(cb, keras.callbacks.History) and (
                not utils.is_default(getattr(cb, hook)) or (hook == "on_train_batch_end"
                                                            and not utils.is_default(cb.on_batch_end))):
            every = True
    return every, bar


def run_steps(coordinator: ClusterCoordinator, fn: Any, steps: list[Step], args: Callable[[Step], tuple],
              on_begin: Callable[[int], None], on_end: Callable[[int, Any], None],
              take: Callable[[Any], None], stop: Callable[[], bool], staleness: int | None) -> None:
    """Schedule ``steps`` (a window ahead), hand each result to ``take`` in order, calling the batch hooks.

    ``stop()`` true after a step's ``on_end`` stops scheduling; the steps
    already scheduled still run and are taken (their updates are on the
    servers). An error waits for the steps already scheduled (a step's own
    error cancels the rest), then is raised; an interrupt cancels them.
    """
    window = max(2, STEPS_AHEAD_PER_TRAINER * max(1, len(coordinator.strategy.trainer_names)))
    pending: deque[tuple[Step, Any]] = deque()
    todo = deque(steps)
    refilling = False
    try:
        while todo or pending:
            while todo and len(pending) < window and not stop() and (len(pending) <= window // 2 or refilling):
                step = todo.popleft()
                on_begin(step.begin)
                pending.append((step, coordinator.schedule(fn, args=args(step), staleness=staleness)))
                refilling = True
            refilling = False
            if not pending:
                break
            step, value = pending.popleft()
            take(value.fetch())
            on_end(step.end, None)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):  # stop now: what is queued never starts
            coordinator.cancel()
        else:  # let the steps already scheduled finish, so that the servers are still when the error is raised
            for _, value in pending:
                with contextlib.suppress(Exception):
                    value.fetch()
        with contextlib.suppress(Exception):
            coordinator.join()  # the first error was raised here: the coordinator must not raise it again
        raise


class _BatchLogs:
    """Batch logs for the hooks, worked out as often as the callbacks need them."""

    def __init__(self, metrics: MetricsState, every: bool, bar: bool):
        self.metrics, self.every, self.bar = metrics, every, bar
        self.last: dict[str, Any] = {}
        self.at = 0.0

    def __call__(self, final: bool = False) -> dict[str, Any] | None:
        now = time.monotonic()
        if self.every or (self.bar and (final or now - self.at >= PROGBAR_INTERVAL)):
            self.last, self.at = self.metrics.logs(), now
        return self.last


def _iterator(coordinator: ClusterCoordinator, plan: Plan, passes: int = 1) -> tuple[Any, Any]:
    """The per-worker dataset of an input and an iterator on it (kept together: the dataset must live).

    A Dask input is read ``passes`` times, each batch once a pass.
    """
    if plan.dask is not None:
        dataset = plan.dask_dataset(coordinator, passes)
    else:
        dataset = coordinator.create_per_worker_dataset(Repeat(plan.source) if plan.is_arrays else plan.source)
    return dataset, iter(dataset)


def _run_test(binding: Binding, model: Any, plan: Plan, callbacks: Any, data_iterator: Any,
              staleness: int | None) -> dict[str, Any]:
    """Keras' evaluation loop over ``plan`` on the trainers; the logs, without the ``val_`` prefix."""
    metrics = MetricsState(model)
    every, bar = _batch_logs_wanted(callbacks, "on_test_batch_end")
    logs = _BatchLogs(metrics, every, bar)
    steps = plan.epoch()
    model.stop_evaluating = False
    callbacks.on_test_begin()
    model_iterator = binding.model_iterator(model)
    last = steps[-1].end if steps else -1
    run_steps(binding.coordinator, binding.test_step, steps,
              lambda s: (model_iterator, data_iterator, s.payload), callbacks.on_test_batch_begin,
              lambda end, _: callbacks.on_test_batch_end(end, logs(end == last)), metrics.add,
              lambda: bool(getattr(model, "stop_evaluating", False)), staleness)
    result = metrics.logs()
    callbacks.on_test_end(result)
    return result


def _first_batch_build(model: Any, plan: Plan) -> None:
    """Let Keras build the compiled metrics (it does so at the first batch) on the local model."""
    if plan.is_arrays:
        try:
            build_from(model, plan.first_batch())
        except (ValueError, TypeError, RuntimeError) as exc:  # checked here, before anything is on a server
            raise ValueError(f"x and y do not fit the model (its inputs, outputs and loss): {exc}") from exc


def _should_validate(epoch: int, validation_freq: Any) -> bool:
    """Keras' rule: every ``validation_freq``-th epoch, or the (1-based) epochs a list names."""
    if isinstance(validation_freq, list):
        return epoch + 1 in validation_freq
    return (epoch + 1) % validation_freq == 0


def _need_y(model: Any) -> bool:
    return model.loss is not None


class _Backups:
    """Keras' ``BackupAndRestore`` keeps the local model; this keeps the servers' side beside it.

    At each epoch's end, before the callbacks run (one of them may stop the
    job before or after Keras writes its backup), a daskps checkpoint of the
    servers' variables, tables and optimizer slots goes to
    ``<backup_dir>/daskps/epoch-<next epoch>``, the name Keras' backup gives
    the epoch to resume at (the two latest are kept). A ``fit`` that starts
    with a Keras backup, on this cluster or a new one, restores the matching
    checkpoint on the servers, so training goes on with the optimizer's
    state as it was, not only with the weights.
    """

    KEEP = 2

    def __init__(self, callbacks: Any, binding: Binding):
        import keras

        self.binding = binding
        self.found = [c for c in callbacks.callbacks if isinstance(c, keras.callbacks.BackupAndRestore)]

    def _dir(self, callback: Any) -> str:
        return callback.backup_dir.rstrip("/") + "/daskps"

    def restore(self, epoch: int) -> bool:
        """Restore the servers as they were when Keras' backup said to resume at ``epoch``; whether one did."""
        import fsspec

        for callback in self.found:
            path = f"{self._dir(callback)}/epoch-{epoch}"
            fs, local = fsspec.url_to_fs(path)
            if epoch > 0 and fs.exists(local):
                self.binding.checkpoint().read(path)
                self.binding.fresh = False
                return True
        return False

    def save(self, next_epoch: int) -> None:
        import fsspec

        for callback in self.found:
            if callback.save_freq != "epoch":
                continue
            self.binding.checkpoint().write(f"{self._dir(callback)}/epoch-{next_epoch}")
            fs, local = fsspec.url_to_fs(self._dir(callback))
            names = sorted((p.rsplit("/", 1)[-1] for p in fs.ls(local, detail=False)),
                           key=lambda n: int(n.split("-")[-1]) if n.split("-")[-1].isdigit() else -1)
            for old in names[:-self.KEEP]:
                fs.rm(f"{local}/{old}", recursive=True)

    def finish(self) -> None:
        """Keras deletes its backup when training ends (``delete_checkpoint=True``): this one goes with it."""
        import fsspec

        for callback in self.found:
            if callback.delete_checkpoint:
                fs, local = fsspec.url_to_fs(self._dir(callback))
                if fs.exists(local):
                    fs.rm(local, recursive=True)


def _train_epoch(binding: Binding, model: Any, train: Plan, cb: Any, iterators: tuple[Any, Any],
                 wanted: tuple[bool, bool], staleness: int | None) -> MetricsState:
    """One epoch's steps on the trainers, batch hooks and all; the metrics' state they added up."""
    metrics = MetricsState(model)
    batch_logs = _BatchLogs(metrics, *wanted)
    steps = train.epoch()
    last = steps[-1].end if steps else -1
    run_steps(binding.coordinator, binding.train_step, steps, lambda s: (*iterators, s.payload),
              cb.on_train_batch_begin, lambda end, _: cb.on_train_batch_end(end, batch_logs(end == last)),
              metrics.add, lambda: bool(model.stop_training), staleness)
    return metrics


def fit(model: Any, x: Any = None, y: Any = None, *, batch_size: int | None = None, epochs: int = 1,
        verbose: Any = "auto", callbacks: Any = None, validation_data: Any = None, shuffle: Any = True,
        initial_epoch: int = 0, steps_per_epoch: int | None = None, validation_steps: int | None = None,
        validation_freq: Any = 1, steps_per_execution: int = 1, coordinator: Any = None,
        staleness: int | None = None, sample_weight: Any = None, class_weight: Any = None) -> Any:
    import keras

    check_model(model, "fit")
    coordinator = resolve_coordinator(coordinator)
    epochs = _positive(epochs, "epochs", allow_zero=True)
    initial_epoch = _positive(initial_epoch, "initial_epoch", allow_zero=True)
    steps_per_execution = _positive(steps_per_execution, "steps_per_execution")
    if shuffle not in (True, False, "batch"):
        raise ValueError(f"shuffle must be True, False or 'batch', got {shuffle!r}")
    if not (isinstance(validation_freq, list) or (isinstance(validation_freq, int) and validation_freq >= 1
                                                  and not isinstance(validation_freq, bool))):
        raise ValueError(f"validation_freq must be a positive integer or a list of epochs, got {validation_freq!r}")
    train = as_source(x, y, sample_weight, class_weight, batch_size, steps_per_epoch, steps_per_execution, shuffle,
                      what="x", steps_arg="steps_per_epoch", need_y=_need_y(model))
    val = None
    if validation_data is not None:
        vx, vy, vsw = validation_parts(validation_data)
        val = as_source(vx, vy, vsw, None, None if is_dataset_fn(vx) else batch_size, validation_steps,
                        steps_per_execution, False, what="validation_data", steps_arg="validation_steps",
                        need_y=_need_y(model))
    if callbacks is not None and not isinstance(callbacks, (list, tuple, keras.callbacks.CallbackList)):
        raise TypeError(f"callbacks must be a list of keras.callbacks.Callback, got {type(callbacks).__name__}")
    _first_batch_build(model, train)
    binding = binding_for(model, coordinator)  # the variables and optimizer on the servers
    finished = False
    try:
        history = _fit(model, binding, train, val, callbacks, verbose, epochs, initial_epoch, validation_freq,
                       staleness)
        finished = True
        return history
    finally:
        if not finished:  # an error or an interrupt: the local model gets what the servers trained so far
            with contextlib.suppress(Exception):
                binding.pull(model)


def _fit(model: Any, binding: Binding, train: Plan, val: Plan | None, callbacks: Any, verbose: Any, epochs: int,
         initial_epoch: int, validation_freq: Any, staleness: int | None) -> Any:
    """Keras' epoch loop, once the inputs are checked and the model's state is on the servers."""
    import keras

    coordinator = binding.coordinator
    _, train_iterator = train_data = _iterator(coordinator, train, epochs - initial_epoch)
    val_passes = sum(_should_validate(e, validation_freq) for e in range(initial_epoch, epochs))
    val_data = _iterator(coordinator, val, val_passes) if val is not None else None
    cb = callbacks if isinstance(callbacks, keras.callbacks.CallbackList) else keras.callbacks.CallbackList(
        callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose, epochs=epochs,
        steps=train.num_batches, model=model)
    model.stop_training = False
    backups = _Backups(cb, binding)
    cb.on_train_begin()
    initial_epoch = model._initial_epoch or initial_epoch  # BackupAndRestore sets it in on_train_begin
    if not backups.restore(initial_epoch):
        binding.push(model, force=True)  # set since the last call, or in on_train_begin (a Keras-only backup)
    binding.sync_learning_rate()
    model_iterator = binding.model_iterator(model)
    every, bar = _batch_logs_wanted(cb, "on_train_batch_end")
    logs: dict[str, Any] = {}
    for epoch in range(initial_epoch, epochs):
        cb.on_epoch_begin(epoch)
        binding.sync_learning_rate()  # LearningRateScheduler sets it in on_epoch_begin
        metrics = _train_epoch(binding, model, train, cb, (model_iterator, train_iterator), (every, bar), staleness)
        binding.pull(model)  # on_epoch_end sees the trained weights (ModelCheckpoint, EarlyStopping)
        logs = metrics.logs()
        if val is not None and _should_validate(epoch, validation_freq):
            assert val_data is not None
            val_logs = _run_test(binding, model, val, cb, val_data[1], staleness)
            logs.update({f"val_{k}": v for k, v in val_logs.items()})
        backups.save(epoch + 1)  # before the callbacks: one may stop the job once Keras' backup is written
        cb.on_epoch_end(epoch, logs)
        binding.sync_learning_rate()  # ReduceLROnPlateau sets it in on_epoch_end
        if model.stop_training:
            break
    binding.pull(model)
    cb.on_train_end(logs)
    backups.finish()
    del train_data, val_data  # the per-worker copies of the data are released on the trainers
    return model.history


def evaluate(model: Any, x: Any = None, y: Any = None, *, batch_size: int | None = None, verbose: Any = "auto",
             steps: int | None = None, callbacks: Any = None, return_dict: bool = False, coordinator: Any = None,
             sample_weight: Any = None) -> Any:
    import keras

    check_model(model, "evaluate")
    coordinator = resolve_coordinator(coordinator)
    plan = as_source(x, y, sample_weight, None, batch_size, steps, model.steps_per_execution, False,
                     what="x", steps_arg="steps", need_y=_need_y(model))
    _first_batch_build(model, plan)
    binding = binding_for(model, coordinator)
    binding.push(model)
    dataset, iterator = _iterator(coordinator, plan)
    cb = callbacks if isinstance(callbacks, keras.callbacks.CallbackList) else keras.callbacks.CallbackList(
        callbacks, add_progbar=verbose != 0, verbose=verbose, epochs=1, steps=plan.num_batches, model=model)
    logs = _run_test(binding, model, plan, cb, iterator, None)
    del dataset
    if return_dict:
        return logs
    return model._flatten_metrics_in_order(logs)


def predict(model: Any, x: Any, *, batch_size: int | None = None, verbose: Any = "auto",
            coordinator: Any = None, steps: int | None = None, callbacks: Any = None) -> Any:
    import keras

    check_model(model, "predict")
    if not model.compiled:
        raise ValueError("model must be compiled before dps.keras.predict: its optimizer runs on the servers "
                         "and its variables are made with it (compile it with any loss)")
    coordinator = resolve_coordinator(coordinator)
    if type(x).__module__.split(".")[0] in ("dask", "dask_expr"):
        return _predict_dask(model, x, batch_size, coordinator)
    plan = as_source(x, None, None, None, batch_size, steps, model.steps_per_execution, False,
                     what="x", steps_arg="steps", need_y=False)
    binding = binding_for(model, coordinator)
    binding.push(model)
    dataset, iterator = _iterator(coordinator, plan)
    cb = callbacks if isinstance(callbacks, keras.callbacks.CallbackList) else keras.callbacks.CallbackList(
        callbacks, add_progbar=verbose != 0, verbose=verbose, epochs=1, steps=plan.num_batches, model=model)
    model_iterator = binding.model_iterator(model)
    outputs: list[Any] = []
    model.stop_predicting = False
    cb.on_predict_begin()
    run_steps(coordinator, binding.predict_step, plan.epoch(), lambda s: (model_iterator, iterator, s.payload),
              cb.on_predict_batch_begin, lambda end, _: cb.on_predict_batch_end(end, {"outputs": outputs[-1]}),
              outputs.extend, lambda: bool(getattr(model, "stop_predicting", False)), None)
    cb.on_predict_end()
    del dataset
    if not outputs:
        raise ValueError("x gave no batches to predict")
    return keras.tree.map_structure(lambda *parts: np.concatenate(parts), *outputs)


def _predict_dask(model: Any, x: Any, batch_size: int | None, coordinator: ClusterCoordinator) -> Any:
    """A Dask Array of predictions, one block per partition of ``x``, computing on the trainers.

    It is returned at once, its blocks being computed (``persist``). Each
    block reads the servers' weights when it is computed and runs the
    model (built once per trainer process) on its rows, ``batch_size`` at a
    time: batch inference over a large collection never passes through here.
    """
    import dask
    import dask.array as da
    import keras
    from dask.graph_manipulation import clone

    from daskps.keras.program import predict_block

    if type(x).__name__ == "DataFrame":
        x = x.to_dask_array(lengths=True)
    if not isinstance(x, da.Array):
        raise TypeError(f"x must be a dask Array or DataFrame (or numpy arrays), got {type(x).__name__}")
    # Keys of its own: a fit that read the same collection may be releasing its copy of x's partitions
    # (the same keys) just now, and the scheduler would cancel these blocks for "lost dependencies".
    x = clone(x, assume_layers=False)
    if x.ndim < 2 or any(len(c) != 1 for c in x.chunks[1:]):
        raise ValueError("x must be a dask Array of rows, chunked along its first axis only "
                         f"(use x.rechunk({{1: -1}})), got chunks {x.chunks}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                   or batch_size < 1):
        raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
    out = model.compute_output_spec(keras.KerasTensor((None,) + tuple(x.shape[1:]), dtype=str(x.dtype)))
    if not isinstance(out, keras.KerasTensor):
        raise ValueError("dps.keras.predict on a Dask collection takes a model with one output")
    binding = binding_for(model, coordinator)
    binding.push(model)
    blob = dask.delayed(binding.model_blob(model), traverse=False)
    lazy = da.map_blocks(predict_block, x, blob, binding.trainable, binding.non_trainable, batch_size or 32,
                         binding.tables, np.empty((0,) + tuple(out.shape[1:]), np.dtype(out.dtype)), binding.pooling,
                         dtype=np.dtype(out.dtype), chunks=(x.chunks[0],) + tuple((d,) for d in out.shape[1:]),
                         drop_axis=list(range(1, x.ndim)) if len(out.shape) < x.ndim else None,
                         new_axis=list(range(x.ndim, len(out.shape))) if len(out.shape) > x.ndim else None,
                         meta=np.empty((0,) * len(out.shape), np.dtype(out.dtype)))
    # Started now, every task of it (reading x included) restricted to the trainers; the blocks stay there.
    resolver = coordinator.strategy.cluster_resolver
    assert resolver is not None and coordinator.strategy.client is not None
    return coordinator.strategy.client.persist(lazy, resources={resolver.worker_resource: 1})
