"""Training from a parquet dataset read with Dask: ``dps.data.from_dask`` on the trainers.

The script writes a small synthetic dataset (feature columns ``f0``, ``f1``,
... and a ``label`` column from a hidden linear "teacher") as parquet files,
a training split and a held-out one, and reads them back with
``dask.dataframe.read_parquet``. ``dps.data.from_dask`` hands each trainer the
partitions it holds: every trainer reads its own share, shuffled, for
``--epochs`` passes, and ``next(iterator, None)`` says when its share is done.
A softmax classifier (numpy gradients, variables on the parameter servers)
learns the teacher; the held-out split is then evaluated exactly once
(``exactly_once=True``: one queue of batches for the whole cluster, every
row counted once even if a trainer dies midway) to measure loss and accuracy.

    python examples/train_from_parquet.py                                  # a local cluster
    python examples/train_from_parquet.py --scheduler tcp://host:8786      # an existing cluster

With an existing cluster on other machines, ``--data-dir`` must be a path
every worker can read (a shared file system; ``read_parquet`` also takes
``s3://`` and other fsspec URLs).

Needs ``pip install ".[data]"`` in the daskps checkout (pandas, pyarrow and Dask's DataFrame).
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import tempfile

import dask.dataframe as dd
import numpy as np
import pandas as pd
from distributed import get_worker

import daskps as dps

NUM_CLASSES = 4


def teacher(features: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(features, NUM_CLASSES)), rng.normal(size=NUM_CLASSES)


def write_split(directory: pathlib.Path, rows: int, features: int, files: int, seed: int) -> None:
    """``files`` parquet files of ``rows`` rows in all, labelled by the teacher (one Dask partition each)."""
    directory.mkdir(parents=True, exist_ok=True)
    w_star, b_star = teacher(features)
    rng = np.random.default_rng(seed)
    for i, n in enumerate(np.diff(np.linspace(0, rows, files + 1).astype(int))):
        x = rng.normal(size=(n, features)).astype(np.float32)
        frame = pd.DataFrame({f"f{j}": x[:, j] for j in range(features)})
        frame["label"] = np.argmax(x @ w_star + b_star, axis=1).astype(np.int64)
        frame.to_parquet(directory / f"part-{i:03d}.parquet", index=False)


def features_and_labels(batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """A batch from a DataFrame is a dict of numpy columns: stack the features, keep the label."""
    x = np.stack([v for k, v in batch.items() if k != "label"], axis=1)
    return x, batch["label"]


def softmax_loss_and_grads(w, b, x, y):
    """Mean cross-entropy of softmax(x @ w + b), its gradients, and the number of right answers."""
    logits = x @ w + b
    right = int((np.argmax(logits, axis=1) == y).sum())
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    n = len(y)
    loss = -np.log(p[np.arange(n), y] + 1e-12).mean()
    p[np.arange(n), y] -= 1.0
    return loss, x.T @ p / n, p.sum(axis=0) / n, right


def run_until_every_trainer_is_done(coordinator, fn, iterator, trainers: set[str], per_round: int):
    """Schedule ``fn(iterator)`` in rounds until every trainer has answered None (its share is read).

    ``fn`` returns ``(trainer name, result or None)``. Yields each round's results (not None).
    """
    done: set[str] = set()
    while done != trainers:
        results = coordinator.fetch([coordinator.schedule(fn, args=(iterator,)) for _ in range(per_round)])
        done |= {name for name, r in results if r is None}
        yield [r for _, r in results if r is not None]


def main(argv=None) -> None:
    args = parse_args(argv)
    local = contextlib.nullcontext() if args.scheduler else dps.LocalPSCluster(num_ps=2, num_workers=2)
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(local)
        strategy = stack.enter_context(dps.ParameterServerStrategy(args.scheduler or cluster.get_client()))
        data_dir = pathlib.Path(args.data_dir or stack.enter_context(tempfile.TemporaryDirectory()))
        coordinator = dps.ClusterCoordinator(strategy)
        trainers = {name for name, _ in strategy.cluster_resolver.training_workers()}

        write_split(data_dir / "train", args.rows, args.features, args.files, seed=1)
        write_split(data_dir / "test", args.test_rows, args.features, max(1, args.files // 4), seed=2)
        train = dd.read_parquet(data_dir / "train")
        test = dd.read_parquet(data_dir / "test")
        print(f"train: {len(train.columns)} columns, {train.npartitions} partitions; "
              f"test: {test.npartitions} partitions", flush=True)

        with strategy.scope():
            w = dps.Variable(np.zeros((args.features, NUM_CLASSES), np.float32), name="w")
            b = dps.Variable(np.zeros(NUM_CLASSES, np.float32), name="b")
            opt = dps.optimizers.SGD(args.lr)

        def train_step(iterator):
            batch = next(iterator, None)  # None once this trainer has read its share, every epoch
            if batch is None:
                return get_worker().name, None
            x, y = features_and_labels(batch)
            loss, gw, gb, _ = softmax_loss_and_grads(*dps.read_values([w, b]), x, y)
            opt.apply_gradients([(gw, w), (gb, b)])
            return get_worker().name, float(loss)

        def eval_step(iterator):
            batch = next(iterator, None)  # None once every batch of the pass has been handed out
            if batch is None:
                return None
            x, y = features_and_labels(batch)
            loss, _, _, right = softmax_loss_and_grads(*dps.read_values([w, b]), x, y)
            return float(loss) * len(y), right, len(y)

        def evaluate() -> tuple[float, float]:
            # Exactly once: the batches come from one queue for the whole cluster, one per call. A
            # function whose trainer dies runs again and gets the same batch, so once a round has
            # seen the end, every held-out row is in exactly one result fetched here.
            data = dps.data.from_dask(test, batch_size=args.batch_size, exactly_once=True)
            it = iter(coordinator.create_per_worker_dataset(data))
            out, done = [], False
            while not done:
                results = coordinator.fetch([coordinator.schedule(eval_step, args=(it,)) for _ in range(16)])
                out += [r for r in results if r is not None]
                done = None in results
            total, right, n = (sum(col) for col in zip(*out))
            assert n == args.test_rows, (n, args.test_rows)  # every held-out row read once
            return total / n, right / n

        loss0, acc0 = evaluate()
        print(f"held-out before training: loss {loss0:.4f}, accuracy {acc0:.3f}", flush=True)

        data = dps.data.from_dask(train, batch_size=args.batch_size, shuffle=True, seed=0, epochs=args.epochs)
        it = iter(coordinator.create_per_worker_dataset(data))
        per_epoch = -(-args.rows // args.batch_size)  # a round: the batches of about one epoch over all trainers
        rounds = run_until_every_trainer_is_done(coordinator, train_step, it, trainers, per_epoch)
        for i, losses in enumerate(rounds):
            if losses:
                print(f"train round {i}: {len(losses)} steps, mean loss {np.mean(losses):.4f}", flush=True)

        loss1, acc1 = evaluate()
        print(f"held-out after training: loss {loss1:.4f}, accuracy {acc1:.3f}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50_000, help="training rows")
    parser.add_argument("--test-rows", type=int, default=10_000, help="held-out rows")
    parser.add_argument("--features", type=int, default=20)
    parser.add_argument("--files", type=int, default=8, help="parquet files (Dask partitions) of the training split")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.5, help="SGD's learning rate")
    parser.add_argument("--data-dir", help="where to write the parquet files (default: a temporary directory)")
    parser.add_argument("--scheduler", help="address of a running daskps cluster (default: start a local one)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
