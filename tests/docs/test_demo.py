"""The main job trains a real CTR model whose answer is known, and resumes from checkpoints."""

import importlib.util
import subprocess
import sys

import pytest

from daskps.demo import DemoConfig, run_demo
from tests.helpers.paths import ROOT

needs_jax = pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                               reason="JAX is not installed (pip install 'daskps[jax]')")


def test_demo_learns_and_resumes(cluster, tmp_path):
    directory = str(tmp_path / "ckpts")
    lines = []
    first = run_demo(DemoConfig(epochs=2, steps_per_epoch=60, checkpoint_dir=directory), cluster=cluster, log=lines.append)
    assert first["resumed_from"] is None and first["epochs_trained"] == 2
    assert first["log_loss"] < first["start_log_loss"] - 0.1
    assert first["auc"] > 0.75 and first["auc"] <= first["teacher_auc"] + 0.01
    assert first["checkpoints"][-1].endswith("ckpt-2")
    again = run_demo(DemoConfig(epochs=3, steps_per_epoch=60, checkpoint_dir=directory), cluster=cluster, log=lines.append)
    assert again["resumed_from"].endswith("ckpt-2") and again["epochs_trained"] == 1
    assert abs(again["start_log_loss"] - first["log_loss"]) < 1e-6  # picks up exactly where it stopped
    assert again["steps"] == first["steps"] + 60 // 4 * 4
    assert again["log_loss"] < first["start_log_loss"]
    assert any("resumed from" in line for line in lines)


@needs_jax
def test_demo_learns_with_jax_gradients(cluster, tmp_path):
    """`daskps demo --model jax`: the same model, gradients from a jitted jax.value_and_grad."""
    lines = []
    result = run_demo(DemoConfig(epochs=2, steps_per_epoch=60, model="jax", checkpoint_dir=str(tmp_path / "ckpts")),
                      cluster=cluster, log=lines.append)
    assert any("jax.value_and_grad" in line for line in lines), lines
    assert result["epochs_trained"] == 2 and result["steps"] == 2 * 60 // 4 * 4
    assert result["log_loss"] < result["start_log_loss"] - 0.1
    assert result["auc"] > 0.75 and result["auc"] <= result["teacher_auc"] + 0.01


@pytest.mark.skipif(importlib.util.find_spec("keras") is None, reason="Keras is not installed")
def test_demo_keras_model_learns_and_resumes_with_its_optimizer_state(cluster, tmp_path):
    """`daskps demo --model keras`: the CTR model in Keras through dps.keras.fit; a rerun goes on."""
    directory = str(tmp_path / "ckpts")
    lines = []
    first = run_demo(DemoConfig(epochs=2, steps_per_epoch=60, model="keras", checkpoint_dir=directory),
                     cluster=cluster, log=lines.append)
    assert first["epochs_trained"] == 2 and first["steps"] == 2 * 60
    assert first["log_loss"] < first["start_log_loss"] - 0.1
    assert first["auc"] > 0.75 and first["auc"] <= first["teacher_auc"] + 0.01
    again = run_demo(DemoConfig(epochs=3, steps_per_epoch=60, model="keras", checkpoint_dir=directory),
                     cluster=cluster, log=lines.append)
    assert again["epochs_trained"] == 1
    assert abs(again["start_log_loss"] - first["log_loss"]) < 1e-6  # the backup's weights, before training
    assert again["steps"] == first["steps"] + 60  # the servers' optimizer came back with its step count
    assert any("resumed from" in line for line in lines)
    assert any("epoch  3/3" in line for line in lines) and not any("epoch  1/3" in line for line in lines)


def test_demo_learns_from_dask_arrays(cluster, tmp_path):
    """`daskps demo --input dask`: the teacher's examples as Dask Arrays, fed through dps.data.from_dask."""
    lines = []
    result = run_demo(DemoConfig(epochs=2, steps_per_epoch=60, input="dask", checkpoint_dir=str(tmp_path / "ckpts")),
                      cluster=cluster, log=lines.append)
    assert any("dps.data.from_dask" in line for line in lines), lines
    assert result["epochs_trained"] == 2 and result["steps"] == 2 * 60 // 4 * 4
    assert result["log_loss"] < result["start_log_loss"] - 0.1
    assert result["auc"] > 0.75 and result["auc"] <= result["teacher_auc"] + 0.01


def test_demo_input_must_be_known():
    with pytest.raises(ValueError, match="input must be one of 'generator', 'dask', got 'csv'"):
        run_demo(DemoConfig(input="csv"))


def test_demo_without_jax_names_the_extra(monkeypatch, capsys):
    from daskps.cli import main

    monkeypatch.setitem(sys.modules, "jax", None)  # as if not installed: importing it fails
    with pytest.raises(ImportError, match=r'pip install "\.\[jax\]" in the daskps checkout'):
        run_demo(DemoConfig(model="jax"))  # before any cluster starts
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--model", "jax"])
    assert exit_.value.code == 2 and 'pip install ".[jax]" in the daskps checkout' in capsys.readouterr().err


@pytest.mark.parametrize("resumed, start, end, code", [
    (None, 0.69, 0.45, 0), (None, 0.45, 0.46, 1),  # a first run must lower the test loss
    ("ckpt-10", 0.448, 0.470, 0), ("ckpt-10", 0.448, 0.480, 1),  # a resumed one may rise by under 0.03
])
def test_the_demo_exits_1_and_says_why_when_training_made_the_model_worse(monkeypatch, capsys, resumed, start,
                                                                          end, code):
    import daskps.cli as cli

    result = {"epochs_trained": 1, "resumed_from": resumed, "start_log_loss": start, "log_loss": end}
    monkeypatch.setattr(cli, "run_demo", lambda config: result)  # the exit code's rule, with no training
    assert cli.main(["demo"]) == code
    err = capsys.readouterr().err
    if code:
        limit = f"{start:.4f}" + (" + 0.03" if resumed else "")
        assert f"made the model worse: test log-loss {end:.4f} at the end, against {limit} before it" in err
    else:
        assert "worse" not in err


def test_demo_rejects_an_unknown_model():
    with pytest.raises(ValueError, match="model must be one of 'numpy', 'jax', 'keras', got 'torch'"):
        run_demo(DemoConfig(model="torch"))


@pytest.mark.cluster
def test_example_script_trains(tmp_path):
    script = ROOT / "examples" / "train_softmax.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    accuracy = float(out.stdout.strip().splitlines()[-1].rsplit(" ", 1)[1])
    assert accuracy > 0.9


def test_demo_survives_a_killed_parameter_server(fresh_cluster, tmp_path):
    """`daskps demo --kill-ps-in-epoch 2`: ps-0 SIGKILLed part-way through epoch 2; training goes on from ckpt-1."""
    cluster, _ = fresh_cluster
    lines = []
    result = run_demo(DemoConfig(epochs=3, steps_per_epoch=60, kill_ps_at_epoch=2,
                                 checkpoint_dir=str(tmp_path / "ckpts")), cluster=cluster, log=lines.append)
    assert any(line.startswith("killing ps-0") for line in lines), lines
    recovered = [line for line in lines if "lost parameter server re-created" in line]
    assert len(recovered) == 1 and "ckpt-1" in recovered[0] and "'model/table'" in recovered[0], lines
    assert result["epochs_trained"] == 3 and result["checkpoints"][-1].endswith("ckpt-3")
    assert result["log_loss"] < result["start_log_loss"] - 0.1 and result["auc"] > 0.75


@pytest.mark.cluster
def test_demo_writes_tensorboard_scalars_with_logdir(tmp_path):
    """`daskps demo --logdir DIR`: an event file TensorBoard reads, with the run's train and test scalars; the
    same command again resumes from the checkpoint it saved and has nothing left to train."""
    pytest.importorskip("tensorboardX")
    from tests.helpers.events import read_scalars

    logdir = tmp_path / "tb"
    cmd = [sys.executable, "-m", "daskps.cli", "demo", "--epochs", "2", "--steps-per-epoch", "80",
           "--checkpoint-dir", str(tmp_path / "ckpts"), "--logdir", str(logdir)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "epoch  2/2" in run.stdout and "saved ckpt-2" in run.stdout
    scalars = read_scalars(logdir)
    final = [line for line in run.stdout.splitlines() if line.startswith("done:")][0]
    test_loss = [v for _, v in scalars["test/log_loss"]]
    assert len(test_loss) == 2 and f"test log-loss {test_loss[-1]:.4f}" in final  # the values the run printed
    # the optimizer's step, as the console prints it (80 steps an epoch, 4 per function), not functions done
    assert [s for s, _ in scalars["test/log_loss"]] == [80, 160] and "optimizer step 160;" in final
    train = scalars["train/loss"]
    assert len(train) >= 2 and train[-1][0] == 160 and [s for s, _ in train] == sorted({s for s, _ in train})
    # a log-loss on balanced-ish labels; never a 0 from a mean just reset by an epoch: that step is left out
    assert all(0 < v < 1 for _, v in train)
    rates = scalars["daskps/examples_per_second"]
    # a rate with each train-loss point (and at a step whose loss was left out as just reset, one without)
    assert {s for s, _ in train} <= {s for s, _ in rates} and all(v > 0 for _, v in rates), (rates, train)
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "resumed from" in rerun.stdout and "nothing to train" in rerun.stdout


@pytest.mark.cluster
def test_demo_logdir_without_tensorboardx_is_refused_before_any_cluster_starts():
    code = ("import sys; sys.modules['tensorboardX'] = None; from daskps.cli import main; "
            "main(['demo', '--logdir', 'tb'])")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2  # argparse's usage error, before anything starts
    assert 'error: --logdir: writing TensorBoard event files needs tensorboardX: pip install ".[tensorboard]" in the daskps checkout' \
        in run.stderr
    assert "starting a LocalPSCluster" not in run.stdout


def test_a_kill_epoch_this_run_does_not_train_is_said_and_nothing_is_killed(cluster, tmp_path):
    """After 2 epochs, `--epochs 2 --kill-ps-in-epoch 2` trains nothing: the demo says why and what to pass."""
    directory = str(tmp_path / "ckpts")
    run_demo(DemoConfig(epochs=2, steps_per_epoch=20, checkpoint_dir=directory), cluster=cluster, log=lambda _: None)
    lines = []
    result = run_demo(DemoConfig(epochs=2, steps_per_epoch=20, checkpoint_dir=directory, kill_ps_at_epoch=2),
                      cluster=cluster, log=lines.append)
    assert result["epochs_trained"] == 0
    said = [line for line in lines if line.startswith("--kill-ps-in-epoch 2: nothing is killed")]
    assert said and "trains no epoch" in said[0] and "--epochs 3 --kill-ps-in-epoch 3" in said[0], lines
    assert not any(line.startswith("killing ps-0") for line in lines)


@pytest.mark.cluster
def test_keep_open_keeps_the_dashboard_up_until_ctrl_c(tmp_path):
    """`daskps demo --keep-open`: after training, daskps' page answers until SIGINT, then the demo ends cleanly."""
    import re
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    cmd = [sys.executable, "-c", "import sys; from daskps.cli import main; sys.exit(main(sys.argv[1:]))", "demo",
           "--epochs", "1", "--steps-per-epoch", "8", "--keep-open", "--checkpoint-dir", str(tmp_path / "ckpts")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    lines = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
            if "stay up until Ctrl-C" in line:
                break
        link = re.search(r"(http://127\.0\.0\.1:\d+/individual-daskps)", lines[-1]).group(1)
        assert any(f"dashboard: {link}" in line for line in lines)  # the page, printed as training started
        with urllib.request.urlopen(link, timeout=30) as page:  # still up after training
            assert page.status == 200 and b"daskps" in page.read()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Ctrl-C: closing the cluster" in out and proc.returncode == 0, out[-2000:]


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_the_readme_path_demo_then_more_epochs_then_a_kill(tmp_path):
    """The README's commands in order, in one directory, as a newcomer runs them: `daskps demo`, again with
    `--epochs 10`, then `--kill-ps-in-epoch 2` (nothing left to train: it says what to pass), then that."""
    import os
    import re

    daskps = os.path.join(os.path.dirname(sys.executable), "daskps")

    def demo(*args):
        out = subprocess.run([daskps, "demo", *args], cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return out.stdout + out.stderr

    first = demo()
    assert "epoch  6/6" in first and "daskps dashboard: http://127.0.0.1:" in first
    assert (tmp_path / "daskps-demo-checkpoints" / "ckpt-6").is_dir()
    more = demo("--epochs", "10")
    assert "resumed from" in more and "ckpt-6 (epoch 6, optimizer step 720)" in more and "epoch 10/10" in more
    told = demo("--kill-ps-in-epoch", "2")
    assert "killing ps-0" not in told and "re-created" not in told
    suggested = re.search(r"e\.g\. (--epochs \d+ --kill-ps-in-epoch \d+)", told)
    assert suggested, told  # says exactly why not, and what to pass
    assert "--kill-ps-in-epoch 2: nothing is killed, as this run trains no epoch (the latest checkpoint has " \
           "10 epochs)" in told
    killed = demo(*suggested.group(1).split())
    assert re.search(r"killing ps-0 \(pid \d+\)", killed), killed
    assert "lost parameter server re-created" in killed and "epoch 11/11" in killed
