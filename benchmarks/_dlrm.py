"""The ``dlrm`` workload of ``compare.py``: data, the model's numpy maths, and AUC.

A DLRM (Naumov et al., 2019) as TorchRec's ``torchrec.models.dlrm.DLRM``
builds it: 13 dense features through a bottom MLP 13-64-16 (ReLU), 8
multi-hot sparse features (bags of 1-20 ids, Zipf-distributed over 100,000
rows each) pooled by mean from tables of dim 16, the pairwise dot products
of the 9 vectors (36) next to the dense vector (16), and a top MLP 52-64-1
(ReLU, then linear) giving a logit; binary log-loss. Labels come from a
fixed random teacher DLRM of the same shape, so the held-out AUC says how
much of the teacher a run learnt. Adagrad, learning rate 0.05, everywhere.

Every system trains on the same batches in the same order (trainer ``i``
takes batches ``i, i + T, ...``) and is scored on the same held-out set.
The data are made once and cached in the system's temporary directory.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

DENSE, TABLES, ROWS, DIM, MAX_BAG = 13, 8, 100_000, 16, 20
BOTTOM, TOP = (13, 64, 16), (52, 64, 1)
BATCH, LR = 256, 0.05
ZIPF = 1.05
TEST = 16_384
PAIRS = np.triu_indices(TABLES + 1, k=1)  # the 36 pairs (i < j) of the 9 vectors


def _zipf_ids(rng: np.random.Generator, n: int, perm: np.ndarray) -> np.ndarray:
    """``n`` ids whose popularity falls as 1 / rank ** ZIPF, ranks scattered over the table by ``perm``."""
    weights = 1.0 / np.arange(1, ROWS + 1) ** ZIPF
    cdf = np.cumsum(weights)
    ranks = np.searchsorted(cdf, rng.random(n) * cdf[-1])
    return perm[np.minimum(ranks, ROWS - 1)]


def init_params(seed: int) -> dict[str, np.ndarray]:
    """The dense layers (Glorot-uniform kernels as Keras/TorchRec draw them, zero biases) and the tables."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, sizes in (("bottom", BOTTOM), ("top", TOP)):
        for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
            limit = np.sqrt(6.0 / (a + b))
            out[f"{name}{i}/w"] = rng.uniform(-limit, limit, size=(a, b)).astype(np.float32)
            out[f"{name}{i}/b"] = np.zeros(b, np.float32)
    bound = 1.0 / np.sqrt(ROWS)  # TorchRec's EmbeddingBagConfig default: uniform(-1/sqrt(rows), 1/sqrt(rows))
    for t in range(TABLES):
        out[f"table{t}"] = rng.uniform(-bound, bound, size=(ROWS, DIM)).astype(np.float32)
    return out


DENSE_NAMES = [f"{n}{i}/{k}" for n, sizes in (("bottom", BOTTOM), ("top", TOP)) for i in range(len(sizes) - 1)
               for k in ("w", "b")]


def _teacher(seed: int) -> dict[str, np.ndarray]:
    p = init_params(seed)
    rng = np.random.default_rng(seed + 1)
    for t in range(TABLES):  # a teacher with something to learn in its tables
        p[f"table{t}"] = rng.normal(scale=0.5, size=(ROWS, DIM)).astype(np.float32)
    return p


def forward(p: dict[str, np.ndarray], dense: np.ndarray, pooled: list[np.ndarray]):
    """The logits, and what :func:`backward` needs."""
    h0 = np.maximum(dense @ p["bottom0/w"] + p["bottom0/b"], 0)
    d = np.maximum(h0 @ p["bottom1/w"] + p["bottom1/b"], 0)
    z = np.stack([d, *pooled], axis=1)  # (B, 9, 16)
    gram = z @ z.transpose(0, 2, 1)
    top_in = np.concatenate([d, gram[:, PAIRS[0], PAIRS[1]]], axis=1)  # (B, 52)
    h2 = np.maximum(top_in @ p["top0/w"] + p["top0/b"], 0)
    logit = (h2 @ p["top1/w"] + p["top1/b"])[:, 0]
    return logit, (dense, h0, d, z, top_in, h2)


def backward(p: dict[str, np.ndarray], saved, dlogit: np.ndarray):
    """Gradients of the dense parameters (by name) and of each pooled vector, given d loss / d logit."""
    dense, h0, d, z, top_in, h2 = saved
    g = {}
    dl = dlogit[:, None].astype(np.float32)
    g["top1/w"], g["top1/b"] = h2.T @ dl, dl.sum(0)
    dh2 = (dl @ p["top1/w"].T) * (h2 > 0)
    g["top0/w"], g["top0/b"] = top_in.T @ dh2, dh2.sum(0)
    dtop = dh2 @ p["top0/w"].T
    dgram = np.zeros((len(z), TABLES + 1, TABLES + 1), np.float32)
    dgram[:, PAIRS[0], PAIRS[1]] = dtop[:, DIM:]
    dz = (dgram + dgram.transpose(0, 2, 1)) @ z
    dd = dtop[:, :DIM] + dz[:, 0]
    dh1 = dd * (d > 0)
    g["bottom1/w"], g["bottom1/b"] = h0.T @ dh1, dh1.sum(0)
    dh0 = (dh1 @ p["bottom1/w"].T) * (h0 > 0)
    g["bottom0/w"], g["bottom0/b"] = dense.T @ dh0, dh0.sum(0)
    return g, [dz[:, 1 + t] for t in range(TABLES)]


def log_loss_grad(logit: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean binary log-loss of ``logit`` and its gradient with respect to each logit."""
    p = 1.0 / (1.0 + np.exp(-logit))
    loss = float(np.mean(np.logaddexp(0, logit) - y * logit))
    return loss, ((p - y) / len(y)).astype(np.float32)


def pool_mean(table: np.ndarray, values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return (np.add.reduceat(table[values], starts, axis=0) / lengths[:, None]).astype(np.float32)


def auc(y: np.ndarray, score: np.ndarray) -> float:
    """The area under the ROC curve (ties counted half), by ranks."""
    order = np.argsort(score, kind="mergesort")
    ranks = np.empty(len(score))
    s = score[order]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    ends = np.r_[starts[1:], len(s)]
    for a, b in zip(starts, ends):
        ranks[order[a:b]] = (a + b + 1) / 2.0
    pos = y > 0.5
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


class Data:
    """Examples ``[0, n)``: dense features, labels, and per table the bags (values, lengths)."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.dense, self.labels, self.lengths = arrays["dense"], arrays["labels"], arrays["lengths"]
        self.values = [arrays[f"values{t}"] for t in range(TABLES)]
        self.offsets = np.zeros((len(self.labels) + 1, TABLES), np.int64)
        np.cumsum(self.lengths, axis=0, out=self.offsets[1:])

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, start: int, stop: int):
        """``(dense, [(values, lengths)] * TABLES, labels)`` of examples ``[start, stop)``."""
        bags = [(self.values[t][self.offsets[start, t]:self.offsets[stop, t]], self.lengths[start:stop, t])
                for t in range(TABLES)]
        return self.dense[start:stop], bags, self.labels[start:stop]


def make_data(n: int, seed: int = 0) -> tuple[Data, Data]:
    """``n`` training examples and ``TEST`` held-out ones (cached on disk)."""
    path = os.path.join(tempfile.gettempdir(), f"daskps-bench-dlrm-{n}-{seed}.npz")
    if not os.path.exists(path):
        rng = np.random.default_rng(seed)
        total = n + TEST
        perms = [rng.permutation(ROWS) for _ in range(TABLES)]
        lengths = rng.integers(1, MAX_BAG + 1, size=(total, TABLES)).astype(np.int64)
        arrays = {"dense": rng.lognormal(size=(total, DENSE)).astype(np.float32) / 4, "lengths": lengths}
        for t in range(TABLES):
            arrays[f"values{t}"] = _zipf_ids(rng, int(lengths[:, t].sum()), perms[t]).astype(np.int64)
        teacher = _teacher(seed + 100)
        logits = []
        data = Data(dict(arrays, labels=np.zeros(total, np.float32)))
        for a in range(0, total, 4096):
            dense, bags, _ = data.batch(a, min(a + 4096, total))
            pooled = [pool_mean(teacher[f"table{t}"], v, ln) for t, (v, ln) in enumerate(bags)]
            logits.append(forward(teacher, dense, pooled)[0])
        z = np.concatenate(logits)
        z = (z - z.mean()) / z.std() * 2.0
        arrays["labels"] = (rng.random(total) < 1 / (1 + np.exp(-z))).astype(np.float32)
        tmp = path + f".{os.getpid()}.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    cut = {k: v for k, v in arrays.items() if not k.startswith("values")}
    lengths = arrays["lengths"]
    split = int(lengths[:n].sum(axis=0)[0]), [int(x) for x in lengths[:n].sum(axis=0)]
    train = {"dense": cut["dense"][:n], "labels": cut["labels"][:n], "lengths": lengths[:n]}
    test = {"dense": cut["dense"][n:], "labels": cut["labels"][n:], "lengths": lengths[n:]}
    for t in range(TABLES):
        train[f"values{t}"] = arrays[f"values{t}"][:split[1][t]]
        test[f"values{t}"] = arrays[f"values{t}"][split[1][t]:]
    return Data(train), Data(test)


def trainer_batches(data: Data, trainer: int, trainers: int) -> list[int]:
    """The batch starts trainer ``trainer`` of ``trainers`` takes: ``trainer, trainer + trainers, ...``."""
    return list(range(trainer * BATCH, len(data) - BATCH + 1, trainers * BATCH))
