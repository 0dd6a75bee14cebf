"""A failing step's traceback names the user's file, line and source, not cloudpickle's ``<dynamic-code>``."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import traceback

import cloudpickle
import pytest

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
