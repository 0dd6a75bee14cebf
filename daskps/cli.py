"""Command line: ``daskps demo`` runs the main job on a local cluster."""

from __future__ import annotations

import argparse
import sys

from daskps.demo import DemoConfig, run_demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="daskps", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a classifier on a local parameter-server cluster")
    defaults = DemoConfig()
    demo.add_argument("--num-ps", type=int, default=defaults.num_ps)
    demo.add_argument("--num-workers", type=int, default=defaults.num_workers)
    demo.add_argument("--epochs", type=int, default=defaults.epochs)
    demo.add_argument("--steps-per-epoch", type=int, default=defaults.steps_per_epoch)
    args = parser.parse_args(argv)
    config = DemoConfig(
        num_ps=args.num_ps,
        num_workers=args.num_workers,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
    )
    result = run_demo(config)
    ok = result["loss_last_epoch"] < result["loss_first_epoch"] and result["test_accuracy"] > 0.8
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
