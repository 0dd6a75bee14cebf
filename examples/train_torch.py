"""A PyTorch ``nn.Module`` trained on parameter servers.

``dps.create_variables(net, name="net")`` makes one variable per entry of
``net.named_parameters()`` (``net/0.weight``, ``net/0.bias``, ...), a dict
keyed by those names. Each step reads them all (one round trip per server),
copies them into the module, runs the forward pass and ``backward()`` with
autograd, and pushes ``{name: p.grad}``: torch tensors go in, numpy arrays
land on the servers. The module is captured by the step function: each
trainer unpickles it once and keeps it between steps.

The target is a hidden "teacher" network.

    python examples/train_torch.py                  # ~15 s on 2 cores
    python examples/train_torch.py --epochs 2 --steps 50
    python examples/train_torch.py --scheduler tcp://host:8786   # an existing cluster

Needs ``pip install ".[torch]"`` in the daskps checkout.
"""

from __future__ import annotations

import argparse
import contextlib

import numpy as np
import torch

import daskps as dps

NUM_FEATURES, HIDDEN = 8, 32


def make_net(seed: int, hidden: int = HIDDEN) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(NUM_FEATURES, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))


def batches(worker: int, batch_size: int):
    """An endless stream of ``(x, y)`` numpy batches labelled by the teacher network."""
    teacher = make_net(seed=0, hidden=16)
    with torch.no_grad():
        for p in teacher.parameters():
            p.mul_(3.0)
    rng = np.random.default_rng([1, worker])
    while True:
        x = rng.normal(size=(batch_size, NUM_FEATURES)).astype(np.float32)
        with torch.no_grad():  # not around the yield: grad mode is per thread, the trainer's too
            y = teacher(torch.from_numpy(x))[:, 0].numpy()
        yield x, y


def train(strategy, coordinator, args) -> list[float]:
    net = make_net(seed=1)
    with strategy.scope():
        variables = dps.create_variables(net, name="net")  # {"0.weight": Variable "net/0.weight", ...}
        optimizer = dps.optimizers.Adam(args.lr)
    print("variables:", {k: v.shape for k, v in variables.items()})

    def train_step(iterator):
        x, y = next(iterator)
        values = dps.read_values(variables)  # {name: numpy array}, one round trip per server
        with torch.no_grad():
            for name, p in net.named_parameters():  # net: this trainer's copy, kept between steps
                p.copy_(torch.as_tensor(values[name]))
        net.zero_grad()
        loss = torch.mean((net(torch.from_numpy(x))[:, 0] - torch.from_numpy(y)) ** 2)
        loss.backward()
        optimizer.apply({name: p.grad for name, p in net.named_parameters()}, variables)
        return loss.item()

    dataset = coordinator.create_per_worker_dataset(lambda ctx: batches(ctx.input_pipeline_id, args.batch_size))
    iterator = iter(dataset)
    means = []
    for epoch in range(args.epochs):
        losses = [coordinator.schedule(train_step, args=(iterator,)) for _ in range(args.steps)]
        coordinator.join()
        means.append(float(np.mean(coordinator.fetch(losses))))
        print(f"torch epoch {epoch}: mean loss {means[-1]:.4f}", flush=True)
    return means


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100, help="steps per epoch")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01, help="Adam's learning rate")
    parser.add_argument("--scheduler", help="address of a running daskps cluster (default: start a local one)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    local = contextlib.nullcontext() if args.scheduler else dps.LocalPSCluster(num_ps=2, num_workers=2)
    with local as cluster, dps.ParameterServerStrategy(args.scheduler or cluster.get_client()) as strategy:
        means = train(strategy, dps.ClusterCoordinator(strategy), args)
        print(f"torch: mean loss {means[0]:.4f} in the first epoch, {means[-1]:.4f} in the last", flush=True)


if __name__ == "__main__":
    main()
