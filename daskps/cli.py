"""Command line: ``daskps demo`` runs the main job on a local cluster."""

from __future__ import annotations

import argparse
import importlib.util
import sys

from daskps.demo import INPUTS, JAX_MISSING, KERAS_MISSING, MODELS, DemoConfig, run_demo
from daskps.ui.tensorboard import TENSORBOARD_MISSING

# Test log-loss a resumed run may end above its start and still exit 0. At the plateau one epoch moves it by
# about 0.006 either way (standard deviation, measured over runs with a server killed in the epoch); 0.03 is
# five of those, and still well short of what a bad restore costs (the untrained model is at 0.69).
RESUMED_SLACK = 0.03


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="daskps", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="train a CTR model (sharded embeddings) on a local parameter-server cluster; reruns resume",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = DemoConfig()
    demo.add_argument("--num-ps", type=int, default=defaults.num_ps, help="parameter servers")
    demo.add_argument("--num-workers", type=int, default=defaults.num_workers, help="trainers")
    demo.add_argument("--epochs", type=int, default=defaults.epochs,
                      help="train up to this epoch (a rerun goes on from the latest checkpoint's)")
    demo.add_argument("--steps-per-epoch", type=int, default=defaults.steps_per_epoch, help="batches per epoch")
    demo.add_argument("--checkpoint-dir", default=defaults.checkpoint_dir,
                      help="where checkpoints go (any fsspec URL); a rerun resumes from the latest")
    demo.add_argument("--kill-ps-in-epoch", "--kill-ps", dest="kill_ps", type=int, default=None, metavar="EPOCH",
                      help="SIGKILL parameter server ps-0 part-way through epoch EPOCH (an epoch number: ps-0 is "
                           "always the server killed), to watch it be recovered; the epoch must be one this run "
                           "trains")
    demo.add_argument("--model", choices=MODELS, default=defaults.model,
                      help="gradients by hand in numpy (the default), from a jitted jax.value_and_grad, or the "
                           "same model written in Keras and trained with dps.keras.fit")
    demo.add_argument("--input", choices=INPUTS, default=defaults.input,
                      help="batches from a generator on each trainer (the default), or from Dask Arrays read "
                           "where their partitions live (dps.data.from_dask)")
    demo.add_argument("--logdir", default=None,
                      help="write TensorBoard scalars here (train loss, examples/s, test log-loss and AUC); "
                           'needs pip install ".[tensorboard]" in the daskps checkout')
    demo.add_argument("--keep-open", action="store_true",
                      help="after training, keep the cluster and its dashboard up until Ctrl-C")
    args = parser.parse_args(argv)
    if args.model == "jax" and importlib.util.find_spec("jax") is None:
        demo.error(JAX_MISSING)
    if args.model == "keras" and (importlib.util.find_spec("keras") is None or importlib.util.find_spec("jax") is None):
        demo.error(KERAS_MISSING)
    if args.model == "keras" and args.kill_ps is not None:
        demo.error("--kill-ps works with --model numpy or jax (a lost server is restored from their checkpoints "
                   "while training goes on); --model keras resumes between runs instead")
    if args.logdir is not None:
        try:
            import tensorboardX  # noqa: F401
        except ImportError:
            demo.error(f"--logdir: {TENSORBOARD_MISSING}")
    config = DemoConfig(
        num_ps=args.num_ps,
        num_workers=args.num_workers,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        checkpoint_dir=args.checkpoint_dir,
        kill_ps_at_epoch=args.kill_ps,
        model=args.model,
        input=args.input,
        logdir=args.logdir,
        keep_open=args.keep_open,
    )
    try:
        result = run_demo(config)
    except KeyboardInterrupt:  # Ctrl-C: the cluster is closed on the way out; say where things stand, briefly
        print(f"\ndaskps demo: interrupted; the cluster is shut down. Checkpoints are in {args.checkpoint_dir}: "
              "run the same command again to resume from the latest.", file=sys.stderr)
        return 130  # as a shell reports a command stopped by SIGINT
    # Exit 1 when training made the model worse. A fresh run must improve on its start; a resumed one
    # starts near the plateau, where asynchronous training moves the test loss by a few thousandths
    # either way, so it may end up to RESUMED_SLACK above where it started.
    if result["epochs_trained"] == 0:
        return 0
    slack = RESUMED_SLACK if result["resumed_from"] is not None else 0.0
    learned = result["log_loss"] < result["start_log_loss"] + slack
    if not learned:
        allowed = f" + {slack}" if slack else ""
        print(f"daskps demo: exit 1, as training made the model worse: test log-loss {result['log_loss']:.4f} "
              f"at the end, against {result['start_log_loss']:.4f}{allowed} before it", file=sys.stderr)
    return 0 if learned else 1


if __name__ == "__main__":
    sys.exit(main())
