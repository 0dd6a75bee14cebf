"""Regenerate tests/data/tf_sparse_cases.json from TensorFlow itself.

    python tests/data/make_tf_sparse_cases.py > tests/data/tf_sparse_cases.json
"""

import json

import numpy as np
import tensorflow as tf


def main():
    rng = np.random.default_rng(0)
    inputs = {
        "f": (rng.normal(size=(6, 2)).astype(np.float32), rng.normal(size=(6, 2)).astype(np.float32)),
        "i": (
            rng.integers(-20, 20, size=(6, 2)).astype(np.int32),
            (rng.integers(1, 5, size=(6, 2)) * rng.choice([-1, 1], size=(6, 2))).astype(np.int32),
        ),
    }
    idx = [0, 3, 3, 5, 0, 3]  # repeats on purpose
    scatter = {}
    for op in ["scatter_add", "scatter_sub", "scatter_mul", "scatter_div", "scatter_min", "scatter_max"]:
        for kind, (base, vals) in inputs.items():
            v = tf.Variable(base)
            getattr(v, op)(tf.IndexedSlices(tf.constant(vals), tf.constant(idx)))
            scatter[f"{op}/{kind}"] = v.numpy().tolist()
    v = tf.Variable(np.zeros((3, 4), np.float32))
    batch_idx, batch_vals = [[0, 2], [1, 3], [3, 0]], [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    v.batch_scatter_update(tf.IndexedSlices(tf.constant(batch_vals), tf.constant(batch_idx)))
    table = np.arange(12.0).reshape(6, 2)
    lookup_ids = [[5, 0], [1, 1]]
    out = {
        "tensorflow": tf.__version__,
        "inputs": {k: [a.tolist(), b.tolist()] for k, (a, b) in inputs.items()},
        "indices": idx,
        "scatter": scatter,
        "batch": {"indices": batch_idx, "values": batch_vals, "result": v.numpy().tolist()},
        "max_norm": {
            "table": table.tolist(),
            "ids": lookup_ids,
            "result": tf.nn.embedding_lookup(table, lookup_ids, max_norm=3.0).numpy().tolist(),
        },
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
