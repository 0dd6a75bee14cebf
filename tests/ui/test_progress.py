"""Progress bars: training steps with metric values, and large checkpoint saves."""

from __future__ import annotations

import io
import time

import numpy as np

import daskps as dps
from daskps.ui.progress import ProgressBar


def test_training_progress_shows_steps_and_metrics(strategy, coordinator):
    with strategy.scope():
        loss = dps.metrics.Mean(name="loss")

    def step(x):
        time.sleep(0.01)
        loss.update_state(x)

    for i in range(40):
        coordinator.schedule(step, args=(float(i),))
    out = io.StringIO()
    bar = dps.progress(coordinator, {"loss": loss}, interval=0.05, file=out, notebook=False)
    assert "40/40 steps" in bar.last and "loss=19.5" in bar.last
    assert out.getvalue().count("\r") >= 1 and out.getvalue().endswith("\n")


def test_progress_raises_what_join_raises(strategy, coordinator):
    coordinator.schedule(lambda: 1 / 0)
    try:
        dps.progress(coordinator, interval=0.02, file=io.StringIO(), notebook=False)
    except ZeroDivisionError:
        pass
    else:
        raise AssertionError("progress() should raise the scheduled function's error")


def test_notebook_form_is_html():
    bar = ProgressBar("saving", 200, "MiB", notebook=False)
    page = bar.html(50, "x=1")
    assert "<progress value='25.0'" in page and "50/200 MiB" in page


def test_large_checkpoint_save_shows_bytes_written(strategy, tmp_path, capsys):
    with strategy.scope():
        parts = [dps.Variable(np.ones((1024, 1024), np.float32), name=f"w/part_{i}") for i in range(2)]
    ckpt = dps.Checkpoint(w=dps.ShardedVariable(parts, name="w"))
    ckpt.write(str(tmp_path / "c"), progress=True)
    err = capsys.readouterr().err
    assert "saving" in err and "8/8 MiB" in err
    ckpt.write(str(tmp_path / "d"))  # 8 MiB: below the automatic threshold, quiet
    assert capsys.readouterr().err == ""


def test_the_bar_is_tqdms_where_tqdm_is_installed_and_daskps_own_on_request():
    import dask.config
    import pytest

    pytest.importorskip("tqdm")  # in the test extra: this runs in CI
    out = io.StringIO()
    bar = ProgressBar("training", 40, "steps", file=out, notebook=False)
    for done in (10, 40):
        bar.update(done, "loss=19.5")
    bar.close()
    drawn = out.getvalue()
    # tqdm's own layout: "desc: pct%|bar| n/total unit [elapsed<remaining, rate], postfix"
    assert "training: 100%|##########| 40/40 steps [" in drawn and "steps/s], loss=19.5" in drawn
    assert "training [" not in drawn and drawn.endswith("\n")

    with dask.config.set({"daskps.progress-bar": "builtin"}):
        out = io.StringIO()
        bar = ProgressBar("training", 40, "steps", file=out, notebook=False)
        bar.update(40, "loss=19.5")
        bar.close()
    assert out.getvalue().startswith("\rtraining [##############################] 40/40 steps")
    assert "%|" not in out.getvalue()

    with dask.config.set({"daskps.progress-bar": "tqdm-please"}):
        with pytest.raises(ValueError, match="daskps.progress-bar must be 'auto' or 'builtin', got 'tqdm-please'"):
            ProgressBar("training", 40, "steps", file=io.StringIO(), notebook=False)


def test_metric_text_reads_result_before_calling_and_names_an_unreadable_metric():
    from daskps.ui.training_progress import metric_text

    class Both:  # a metric object that is also callable: its result() is what is shown
        def result(self):
            return 0.123456

        def __call__(self):
            return 99.0

    def broken():
        raise KeyError("not yet")

    assert metric_text(None) == "" and metric_text({}) == ""
    assert metric_text({"loss": Both(), "lr": lambda: 0.001, "bad": broken}) == "loss=0.1235 lr=0.001 bad=<KeyError>"


def test_progress_labels_its_bar_training_and_draws_it_where_asked(strategy, coordinator, capsys):
    import dask.config

    for _ in range(4):
        coordinator.schedule(lambda: None)
    out = io.StringIO()
    with dask.config.set({"daskps.progress-bar": "builtin"}):
        bar = dps.progress(coordinator, interval=0.01, file=out, notebook=False)
    assert bar.last.startswith("training [") and out.getvalue().startswith("\rtraining [")
    for _ in range(4):
        coordinator.schedule(lambda: None)
    out = io.StringIO()
    with dask.config.set({"daskps.progress-bar": "builtin"}):
        bar = dps.progress(coordinator, interval=0.01, file=out, notebook=True)  # the HTML form, not the file
    assert out.getvalue() == "" and bar.last.startswith("training [") and "4/4 steps" in bar.last
    assert "IPython.core.display.HTML" in capsys.readouterr().out  # shown by display(): outside IPython, its repr
