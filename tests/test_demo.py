"""The main job trains a real model whose answer is known."""

import subprocess
import sys

from daskps.demo import DemoConfig, run_demo


def test_demo_learns_the_teacher(cluster):
    lines = []
    result = run_demo(DemoConfig(epochs=4, steps_per_epoch=60), cluster=cluster, log=lines.append)
    assert result["loss_last_epoch"] < result["loss_first_epoch"]
    assert result["test_accuracy"] > 0.9
    assert result["weight_cosine"] > 0.9
    assert any("epoch  4/4" in line for line in lines)


def test_daskps_demo_command_runs_end_to_end():
    out = subprocess.run(
        [sys.executable, "-m", "daskps.cli", "demo", "--epochs", "2", "--steps-per-epoch", "40"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "epoch  2/2" in out.stdout
    assert "final test accuracy" in out.stdout


def test_example_script_trains(tmp_path):
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "train_softmax.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    accuracy = float(out.stdout.strip().splitlines()[-1].rsplit(" ", 1)[1])
    assert accuracy > 0.9
