"""How evenly a Zipf-distributed batch spreads over the parameter servers, by row layout.

For a table of ``--rows`` rows over ``--servers`` servers, draws batches of
``--batch`` ids from Zipf(``--a``) (rank r with probability proportional to
r**-a) and counts, per server, the distinct rows a batch touches (what the
server reads and updates). Reports max/mean over servers, averaged over
``--batches`` batches, for:

- ``div``: server = id // ceil(rows / servers) (TensorFlow's "div", daskps' ShardedVariable);
- ``mod``: server = id % servers (TensorFlow 1's partition_strategy="mod"; daskps'
  ``ShardedVariable(..., layout="mod")``, whose shards hold exactly these rows: tested);
- ``hash``: server = splitmix64(id) % servers (daskps' EmbeddingTable).

Two numberings of the ids: by popularity (id 0 the most frequent: how
vocabularies built by frequency come out, the worst case for "div") and a
random permutation of it. No timing: the figures are exact counts.

    python benchmarks/bench_layout_load.py
"""

from __future__ import annotations

import argparse

import numpy as np

from daskps._core.hashing import server_of


def zipf_ranks(rng: np.random.Generator, a: float, n: int, size: int) -> np.ndarray:
    """``size`` ranks in ``[0, n)`` with P(r) proportional to (r + 1) ** -a."""
    p = np.arange(1, n + 1, dtype=np.float64) ** -a
    return rng.choice(n, size=size, p=p / p.sum())


def imbalance(servers_of_rows: np.ndarray, servers: int) -> float:
    counts = np.bincount(servers_of_rows, minlength=servers)
    return float(counts.max() / counts.mean())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--servers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--a", type=float, default=1.1)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    permutation = rng.permutation(args.rows)
    batches = [np.unique(zipf_ranks(rng, args.a, args.rows, args.batch)) for _ in range(args.batches)]
    print(f"Zipf({args.a}) batches of {args.batch} ids over {args.rows:,} rows: distinct rows per server, "
          f"max/mean (1.00 is even), mean of {args.batches} batches")
    print("| servers | ids numbered | div | mod | hash (EmbeddingTable) |")
    print("| --- | --- | --- | --- | --- |")
    for s in args.servers:
        per = -(-args.rows // s)
        for label, ids_of in (("by popularity", lambda r: r), ("permuted", lambda r: permutation[r])):
            div = np.mean([imbalance(ids_of(b) // per, s) for b in batches])
            mod = np.mean([imbalance(ids_of(b) % s, s) for b in batches])
            hashed = np.mean([imbalance(server_of(ids_of(b), s), s) for b in batches])
            print(f"| {s} | {label} | {div:.2f} | {mod:.2f} | {hashed:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
