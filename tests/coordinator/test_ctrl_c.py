"""Ctrl-C in a terminal, as a person presses it: a pseudo-terminal sends SIGINT to the whole foreground
process group (the script and every worker process it started), and what the terminal shows is counted.

Worker processes of a ``LocalPSCluster`` ignore SIGINT (their script's exit closes them); the demo says in
one line where things stand; a user's script shows Python's own traceback of the user's code.
"""

from __future__ import annotations

import os
import re
import select
import sys
import time

import pytest

from tests.helpers.docs import CLUSTER_BLOCKS

pytestmark = [pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX"), pytest.mark.cluster]


def run_in_a_terminal(argv, cwd, ready: str, timeout: float = 240) -> tuple[str, str, int]:
    """Run ``argv`` on a pty, press Ctrl-C once ``ready`` is on the screen; (before, after, exit status)."""
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the child: a new session whose terminal is the pty, as a shell's foreground job
        try:
            os.chdir(cwd)
            os.execv(argv[0], argv)
        finally:
            os._exit(127)  # never go on running pytest in the child
    out, pressed_at, status, last_press = b"", None, None, 0.0
    deadline = time.monotonic() + timeout
    try:
        while status is None:
            assert time.monotonic() < deadline, f"no end in {timeout} s:\n{out.decode(errors='replace')[-3000:]}"
            if pressed_at is None and ready in out.decode(errors="replace"):
                time.sleep(1.0)  # well into the work
                pressed_at, last_press = len(out), time.monotonic()
                os.write(fd, b"\x03")  # the terminal turns it into SIGINT for the foreground group
            elif pressed_at is not None and time.monotonic() - last_press > 15:
                # Python drops an interrupt that lands in a gc callback (Dask's, in this process): pressed
                # again, as a person would when nothing happens
                last_press = time.monotonic()
                os.write(fd, b"\x03")
            if select.select([fd], [], [], 0.1)[0]:
                try:
                    out += os.read(fd, 65536)
                except OSError:  # the child closed the terminal
                    pass
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                status = code
        while select.select([fd], [], [], 0.2)[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    finally:
        if status is None:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(fd)
    assert pressed_at is not None, f"never saw {ready!r}:\n{out.decode(errors='replace')[-3000:]}"
    text = out.decode(errors="replace").replace("\r\n", "\n")
    cut = len(out[:pressed_at].decode(errors="replace").replace("\r\n", "\n"))
    return text[:cut], text[cut:], status


@pytest.mark.timeout(300)
def test_ctrl_c_in_the_demo_prints_one_message(tmp_path):
    daskps = os.path.join(os.path.dirname(sys.executable), "daskps")
    before, after, status = run_in_a_terminal(
        [daskps, "demo", "--epochs", "200", "--checkpoint-dir", str(tmp_path / "ck")], tmp_path, ready="/200  train loss")
    assert "interrupted" in after, after  # the interrupt happened, during training
    lines = [line for line in after.splitlines() if line.strip() and line.strip() != "^C"]
    assert len(lines) <= 15, after
    assert "Traceback" not in after and "KeyboardInterrupt" not in after, after
    assert os.WEXITSTATUS(status) == 130, status


@pytest.mark.timeout(300)
def test_ctrl_c_in_the_readme_script_prints_the_users_traceback_alone(tmp_path):
    first = next(b for b in CLUSTER_BLOCKS if not b.notebook)
    code = first.code.replace("for _ in range(400)]", "for _ in range(20_000)]")  # still training when pressed
    # pressed while join() waits, as a person waiting on training does (pressed in the middle of Python
    # code that allocates, Dask's gc callback in this process can swallow the interrupt: Python ignores
    # exceptions in gc callbacks)
    code = code.replace("    coordinator.join()", "    print('training', flush=True)\n    coordinator.join()")
    assert code.count("print('training'") == 1
    (tmp_path / "first.py").write_text(code)
    before, after, status = run_in_a_terminal([sys.executable, str(tmp_path / "first.py")], tmp_path,
                                              ready="training")
    assert "KeyboardInterrupt" in after, after  # the interrupt happened, in the script
    lines = [line for line in after.splitlines() if line.strip() and line.strip() != "^C"]
    assert len(lines) <= 15, after
    assert after.count("Traceback (most recent call last)") == 1, after  # the script's; none from a worker
    assert re.search(r'File ".*first\.py", line \d+, in main', after), after
