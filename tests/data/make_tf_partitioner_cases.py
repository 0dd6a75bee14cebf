"""Regenerate tests/data/tf_partitioner_cases.json from TensorFlow itself.

Run with a Python that has tensorflow installed (not a daskps dependency):

    python tests/data/make_tf_partitioner_cases.py > tests/data/tf_partitioner_cases.json
"""

import json
import random

import tensorflow as tf

P = tf.distribute.experimental.partitioners
DTYPES = ["float16", "float32", "float64", "int8", "int32", "int64", "uint8", "bool", "complex64", "string"]


def tf_call(kind, args, shape, dtype, axis):
    ts, dt = tf.TensorShape(shape), tf.as_dtype(dtype)
    if kind == "FixedShardsPartitioner":
        return P.FixedShardsPartitioner(**args)(ts, dt, axis=axis)
    if kind == "MinSizePartitioner":
        return P.MinSizePartitioner(**args)(ts, dt, axis=axis)
    if kind == "MaxSizePartitioner":
        return P.MaxSizePartitioner(**args)(ts, dt, axis=axis)
    if kind == "fixed_size_partitioner":
        return tf.compat.v1.fixed_size_partitioner(args["num_shards"], axis=axis)(shape=ts, dtype=dt)
    if kind == "min_max_variable_partitioner":
        return tf.compat.v1.min_max_variable_partitioner(axis=axis, **args)(shape=ts, dtype=dt)
    return tf.compat.v1.variable_axis_size_partitioner(axis=axis, **args)(shape=ts, dtype=dt)


def random_args(kind, r):
    if kind in ("FixedShardsPartitioner", "fixed_size_partitioner"):
        return {"num_shards": r.randint(1, 40)}
    if kind == "MinSizePartitioner":
        return {"min_shard_bytes": r.choice([1, 4, 100, 1000, 4096, 256 << 10]), "max_shards": r.randint(1, 64),
                "bytes_per_string": r.choice([1, 16, 64])}
    if kind == "min_max_variable_partitioner":
        return {"max_partitions": r.randint(1, 64), "min_slice_size": r.choice([1, 4, 100, 1000, 4096, 256 << 10]),
                "bytes_per_string_element": r.choice([1, 16, 64])}
    if kind == "MaxSizePartitioner":
        return {"max_shard_bytes": r.choice([1, 4, 100, 1000, 4096, 64 << 10, 1 << 20]),
                "max_shards": r.choice([None, 1, 2, 7, 100]), "bytes_per_string": r.choice([1, 16, 64])}
    return {"max_shard_bytes": r.choice([1, 4, 100, 1000, 4096, 64 << 10, 1 << 20]),
            "max_shards": r.choice([None, 1, 2, 7, 100]), "bytes_per_string_element": r.choice([1, 16, 64])}


def main():
    r = random.Random(1234)
    kinds = ["FixedShardsPartitioner", "MinSizePartitioner", "MaxSizePartitioner", "fixed_size_partitioner",
             "min_max_variable_partitioner", "variable_axis_size_partitioner"]
    cases = []
    for i in range(600):
        kind = kinds[i % len(kinds)]
        rank = r.randint(1, 3)
        shape = [r.choice([1, 2, 3, 5, 13, 64, 100, 1000, 4097, 100000]) for _ in range(rank)]
        axis = r.randrange(rank) if r.random() < 0.3 else 0
        dtype = r.choice(DTYPES)
        args = random_args(kind, r)
        result = [int(x) for x in tf_call(kind, args, shape, dtype, axis)]
        cases.append({"kind": kind, "args": args, "shape": shape, "dtype": dtype, "axis": axis, "result": result})
    print(json.dumps({"tensorflow": tf.__version__, "cases": cases}, indent=None))


if __name__ == "__main__":
    main()
