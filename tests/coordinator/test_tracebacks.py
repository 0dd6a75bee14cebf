"""A failing step's traceback names the user's file, line and source, not cloudpickle's ``<dynamic-code>``."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import traceback

import cloudpickle
import pytest

pytestmark = pytest.mark.cluster  # every test here starts a cluster or a process

SOURCE = textwrap.dedent('''
    import numpy as np


    def failing_step(scale):
        x = np.ones(3) * scale
        if x.sum() > 0:
            raise ValueError("bad batch")  # the line the traceback shows
        return x
''')


def test_a_failing_steps_traceback_shows_the_users_file_line_and_source(coordinator, tmp_path):
    path = tmp_path / "user_steps.py"
    path.write_text(SOURCE)
    spec = importlib.util.spec_from_file_location("user_steps_for_traceback", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[spec.name] = module
    cloudpickle.register_pickle_by_value(module)  # as a script's own functions travel: by value
    try:
        remote = coordinator.schedule(module.failing_step, args=(2.0,))
        path.unlink()  # as on another machine: the trainer must show the lines that came with the function
        with pytest.raises(ValueError, match="bad batch") as raised:
            coordinator.join()
        with pytest.raises(ValueError):
            remote.fetch()
    finally:
        cloudpickle.unregister_pickle_by_value(module)
        del sys.modules[spec.name]
    shown = "".join(traceback.format_exception(raised.value))
    assert "<dynamic-code>" not in shown, shown
    on_trainer = shown.split("raised in a scheduled function on a worker:")[-1]  # as the trainer wrote it
    for text in (shown, on_trainer):
        assert f'File "{path}", line 8, in failing_step' in text, shown
        assert 'raise ValueError("bad batch")  # the line the traceback shows' in text, shown


UNPICKLABLE = textwrap.dedent('''
    import threading

    import numpy as np

    import daskps as dps


    def main(cluster):
        strategy = dps.ParameterServerStrategy(cluster)
        coordinator = dps.ClusterCoordinator(strategy)
        with strategy.scope():
            w = dps.Variable(np.zeros(2), name="w")

        def step():
            w.assign_add(np.ones(2))
            return threading.Lock()  # a result that cannot be pickled

        coordinator.schedule(step)
        coordinator.join()


    if __name__ == "__main__":
        with dps.LocalPSCluster(num_ps=1, num_workers=1) as cluster:
            main(cluster)
''')


@pytest.mark.timeout(240)
def test_a_result_that_cannot_be_pickled_prints_daskps_line_without_dasks_serializer_traceback(tmp_path):
    import subprocess

    script = tmp_path / "unpicklable.py"
    script.write_text(UNPICKLABLE)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=200)
    assert out.returncode == 1
    assert "TypeError: the result of a scheduled function cannot be pickled: cannot pickle '_thread.lock' object" \
        in out.stderr, out.stderr
    assert "distributed.protocol.pickle" not in out.stderr and "cloudpickle.py" not in out.stderr, out.stderr
    assert out.stderr.count("Traceback (most recent call last)") == 1, out.stderr  # the script's own


def test_a_captured_object_that_cannot_be_pickled_is_named_without_pickles_traceback(coordinator):
    import threading

    lock = threading.Lock()

    def step():
        return lock.locked()

    with pytest.raises(TypeError, match=r"cannot pickle variable 'lock' captured by .*step \(a _thread\.lock\)") as info:
        coordinator.schedule(step)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert "cloudpickle" not in "".join(traceback.format_exception(info.value))
