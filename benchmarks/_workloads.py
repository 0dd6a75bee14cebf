"""The four workloads of ``compare.py``: model maths and data, shared by the numpy systems.

- ``dispatch``: empty functions.
- ``dense``: MLP 784 -> 256 (relu) -> 10, softmax cross-entropy.
- ``dense_jax``: the same MLP, data and placement, its loss and gradients from one
  ``jax.jit(jax.value_and_grad(loss))`` (daskps only: what a JAX user's step costs).
- ``ctr``: 8 fields x 100,000 ids, embedding dim 16 (one 800,000 x 16 table),
  logits = concat(embeddings) @ w (128 x 1), sigmoid cross-entropy; sparse gradients.
- ``ctr_hash``: ``ctr`` with the table an ``EmbeddingTable`` (hash-keyed rows made on
  first sight; daskps only: read against daskps' own ``ctr``).
- ``small``: 64 variables of 32 floats, every one read and updated each step.

Batch 256, SGD with learning rate 0.05. Each trainer cycles through a few
batches generated once, so data generation is not what is measured.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time

import numpy as np

BATCH = 256
LR = 0.05
FIELDS, VOCAB, DIM = 8, 100_000, 16
SMALL_VARS, SMALL_SIZE = 64, 32
N_BATCHES = 4


def dense_init(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.normal(size=(784, 256)) * 0.05).astype(np.float32),
        "b1": np.zeros(256, np.float32),
        "w2": (rng.normal(size=(256, 10)) * 0.05).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }


def dense_batches(worker: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(100 + worker)
    return [(rng.normal(size=(BATCH, 784)).astype(np.float32), rng.integers(0, 10, BATCH)) for _ in range(N_BATCHES)]


def dense_grads(w1, b1, w2, b2, x, y):
    """Loss and gradients of the MLP for one batch (numpy)."""
    h = x @ w1 + b1
    a = np.maximum(h, 0)
    logits = a @ w2 + b2
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    loss = -np.log(p[np.arange(len(y)), y] + 1e-9).mean()
    g = p
    g[np.arange(len(y)), y] -= 1
    g /= len(y)
    gw2, gb2 = a.T @ g, g.sum(axis=0)
    gh = (g @ w2.T) * (h > 0)
    return loss, (x.T @ gh, gh.sum(axis=0), gw2, gb2)


MODEL_CPU = [0.0, 0, 0.0]  # CPU seconds in the model's maths in this process, calls, wall seconds (profile_step.py)


def counted(fn):
    """``fn``, adding the CPU time of this thread spent in it to ``MODEL_CPU`` of the process it runs in."""

    def run(*args):
        import _workloads  # this process's module, wherever the function was unpickled

        start, began = time.thread_time(), time.perf_counter()
        try:
            return fn(*args)
        finally:
            _workloads.MODEL_CPU[0] += time.thread_time() - start
            _workloads.MODEL_CPU[1] += 1
            _workloads.MODEL_CPU[2] += time.perf_counter() - began

    return run


def dense_jax_grad():
    """The MLP's ``(loss, grads) = f(params, x, y)`` as one jitted JAX function; ``params`` a dict as ``dense_init``'s."""
    import jax
    import jax.numpy as jnp

    def loss(params, x, y):
        h = jnp.maximum(x @ params["w1"] + params["b1"], 0)
        logp = jax.nn.log_softmax(h @ params["w2"] + params["b2"])
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    return jax.jit(jax.value_and_grad(loss))


def dense_keras_model():
    """The MLP of ``dense`` as a compiled Keras 3 model: the same shapes, initial weights, loss and SGD."""
    import keras

    init = dense_init()
    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
    model.set_weights([init["w1"], init["b1"], init["w2"], init["b2"]])
    model.compile(optimizer=keras.optimizers.SGD(LR),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def ctr_table(shape, dtype, partition_shape=None, partition_offset=None):
    """Initializer for the embedding table (each shard builds its own rows)."""
    rows = partition_shape or shape
    rng = np.random.default_rng(0 if partition_offset is None else partition_offset[0])
    return (rng.normal(size=rows) * 0.01).astype(dtype)


def ctr_hash_init(shape, dtype):
    """Initializer for ``ctr_hash``'s table: new rows as ``ctr_table`` draws them."""
    return (np.random.default_rng().normal(size=shape) * 0.01).astype(dtype)


def ctr_batches(worker: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(200 + worker)
    out = []
    for _ in range(N_BATCHES):
        ids = rng.integers(0, VOCAB, size=(BATCH, FIELDS)) + np.arange(FIELDS) * VOCAB
        out.append((ids.astype(np.int64), (rng.random(BATCH) < 0.3).astype(np.float32)))
    return out


def ctr_grads(rows, w, ids, y):
    """Loss and gradients given the embedding rows of ``ids`` (shape ids.shape + (DIM,))."""
    emb = rows.reshape(len(ids), FIELDS * DIM)
    z = (emb @ w)[:, 0]
    p = 1 / (1 + np.exp(-z))
    loss = -np.mean(y * np.log(p + 1e-7) + (1 - y) * np.log(1 - p + 1e-7))
    g = ((p - y) / len(y)).astype(np.float32)[:, None]
    row_grads = (g @ w.T).reshape(len(ids) * FIELDS, DIM)
    return loss, row_grads, emb.T @ g


def small_init() -> list[np.ndarray]:
    return [np.full(SMALL_SIZE, i / SMALL_VARS, np.float32) for i in range(SMALL_VARS)]


def small_grads(values: list[np.ndarray]) -> list[np.ndarray]:
    return [np.float32(0.01) * v + np.float32(0.001) for v in values]


EXAMPLES_PER_STEP = {"dispatch": 1, "dense": BATCH, "dense_jax": BATCH, "keras_fit": BATCH, "keras_fit4": BATCH,
                     "ctr": BATCH, "small": 1}
# A thousand empty functions take a tenth of a second: each system times them three times, keeping the best.
REPEATS = {"dispatch": 3}


def timed_schedule(coordinator, fn, args, steps: int, warmup: int, name: str = "", first=()) -> float:
    """Steps per second of ``steps`` calls of ``fn`` through ``coordinator.schedule`` and ``join``.

    ``first`` (functions) and ``warmup`` calls of ``fn`` run untimed before.
    Works with daskps' and TensorFlow's coordinators alike.
    """
    for f in first:
        coordinator.schedule(f)
    for _ in range(warmup):
        coordinator.schedule(fn, args=args)
    coordinator.join()

    def run():
        for _ in range(steps):
            coordinator.schedule(fn, args=args)
        coordinator.join()

    return best_rate(name, steps, run)


def best_rate(name: str, steps: int, run) -> float:
    """The best of ``REPEATS`` timings of ``run()`` (which does ``steps`` steps), in steps per second."""
    best = 0.0
    for _ in range(REPEATS.get(name, 1)):
        with AROUND_TIMED():
            start = time.perf_counter()
            run()
            best = max(best, steps / (time.perf_counter() - start))
    return best


# Entered around each timed run (after the warm-up): profile_step.py measures the processes there.
AROUND_TIMED = contextlib.nullcontext
UNITS = {"dispatch": "functions/s", "dense": "examples/s", "dense_jax": "examples/s", "keras_fit": "examples/s",
         "keras_fit4": "examples/s", "ctr": "examples/s",
         "ctr_hash": "examples/s",
         "small": "steps/s", "dlrm": "examples/s"}


def run_child(cmd: list[str], timeout: float, **env: str) -> dict:
    """Run a benchmark's child process (with ``env`` added, and this folder on its path); return the dict it
    printed on its ``RESULT`` line, or ``{"error": ...}`` with the last error it wrote."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout}s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    lines = done.stderr.strip().splitlines() or ["no output"]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line)]
    return {"error": (errors or lines)[-1][:300]}


# -- the compute bound: each workload's maths alone ----------------------------------------------
def _dense_maths():
    params = list(dense_init().values())
    batches = dense_batches(0)

    def step(i):
        x, y = batches[i % N_BATCHES]
        _, grads = dense_grads(*params, x, y)
        for p, g in zip(params, grads):
            p -= LR * g

    return step


def _ctr_maths():
    table = ctr_table((FIELDS * VOCAB, DIM), np.float32)
    w = np.full((FIELDS * DIM, 1), 0.01, np.float32)
    batches = ctr_batches(0)

    def step(i):
        nonlocal w
        ids, y = batches[i % N_BATCHES]
        flat = ids.ravel()
        _, row_grads, gw = ctr_grads(table[flat], w, ids, y)
        np.subtract.at(table, flat, LR * row_grads)  # repeated ids add up, as IndexedSlices do
        w -= LR * gw

    return step


def _small_maths():
    values = small_init()

    def step(i):
        for v, g in zip(values, small_grads(values)):
            v -= LR * g

    return step


BOUND_MATHS = {"dense": _dense_maths, "ctr": _ctr_maths, "small": _small_maths}


def maths_rate(workload: str, seconds: float = 1.0) -> float:
    """Steps per second of ``workload``'s maths alone in this thread: the gradients and the SGD update on
    arrays held here, with no parameter server, no copies beyond the maths' own and no framework.
    Run with one BLAS thread, it times one core's share of the machine's compute bound."""
    step = BOUND_MATHS[workload]()
    for i in range(20):
        step(i)
    best = 0.0
    for _ in range(3):  # the best of three slices: a neighbour's burst does not lower the bound
        n, start = 0, time.perf_counter()
        while (took := time.perf_counter() - start) < seconds / 3:
            step(n)
            n += 1
        best = max(best, n / took)
    return best
