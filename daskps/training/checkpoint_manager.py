"""``CheckpointManager``: numbered checkpoints in a directory, and which of them are kept.

It saves ``ckpt-N`` through its :class:`~daskps.training.checkpoint.Checkpoint`
(at most every ``checkpoint_interval`` steps when told the step), keeps the
``max_to_keep`` newest and, with ``keep_checkpoint_every_n_hours``, one per
that many hours for good (marked ``PRESERVED``), and finds the latest for
``restore_or_initialize``; the coordinator asks it how many functions had
finished at each checkpoint (``count_finished_with``) to re-run what a
restore rolled back.
"""

from __future__ import annotations

import inspect
import json
import numbers
import os
import re
import time
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import fsspec
import numpy as np

from daskps._core.arrays import is_int
from daskps.training.checkpoint import Checkpoint
from daskps.training.manifest import MANIFEST, PRESERVED, committed_numbers

__all__ = ["CheckpointManager"]


def _written_at(fs: Any, root: str) -> float:
    """When the checkpoint at ``root`` was committed (its manifest's time; 0 if it has none)."""
    try:
        return float(json.loads(fs.cat_file(f"{root}/{MANIFEST}")).get("time", 0.0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0.0


def _step_of(counter: Any) -> int:
    value = np.asarray(counter.numpy() if hasattr(counter, "numpy") else counter)
    if value.shape != () or value.dtype.kind not in "iu":
        raise ValueError(f"step_counter must be a scalar int variable (such as optimizer.iterations), "
                         f"got {value.dtype} {value.shape}")
    return int(value)


def _positive_int_or_none(value: Any, arg: str) -> int | None:
    """``value`` if it is None or an int >= 1: ``TypeError`` for another type, ``ValueError`` below 1."""
    if value is None:
        return None
    if not is_int(value):
        raise TypeError(f"{arg} must be a positive int or None, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{arg} must be a positive int or None, got {value!r}")
    return int(value)


class CheckpointManager:
    """Numbered checkpoints in ``directory``, keeping the newest ``max_to_keep``.

    Parameters
    ----------
    checkpoint : Checkpoint
    directory : str or path-like
        A local directory or any fsspec URL.
    max_to_keep : int or None
        At least 1 (as in TensorFlow); ``None`` keeps every checkpoint.
    keep_checkpoint_every_n_hours : float or None
        A checkpoint leaving the newest ``max_to_keep`` is kept for good
        (marked ``PRESERVED``, no longer managed) when at least this many
        hours passed since the last one kept that way, as in TensorFlow.
    checkpoint_name : str
        Checkpoints are ``directory/{checkpoint_name}-{n}``.
    step_counter : Variable or None
        A scalar int variable (``optimizer.iterations``, say): with
        ``checkpoint_interval``, the step count :meth:`save` looks at.
    checkpoint_interval : int or None
        ``save()`` writes only once ``step_counter`` moved on by at least this
        many steps since the last save, so a loop may call it after every
        ``join()``. Needs ``step_counter``.
    init_fn : callable, optional
        Called by :meth:`restore_or_initialize` when there is nothing to restore.
    """

    def __init__(self, checkpoint: Checkpoint, directory: str, max_to_keep: int | None = 5,
                 keep_checkpoint_every_n_hours: float | None = None, checkpoint_name: str = "ckpt",
                 step_counter: Any = None, checkpoint_interval: int | None = None,
                 init_fn: Callable[[], Any] | None = None):
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"checkpoint must be a daskps.Checkpoint, got {type(checkpoint).__name__}")
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a str (a path or an fsspec URL), got {type(directory).__name__}")
        directory = os.fspath(directory)
        max_to_keep = _positive_int_or_none(max_to_keep, "max_to_keep")  # TensorFlow refuses 0 and below too
        if not isinstance(checkpoint_name, str):
            raise TypeError(f"checkpoint_name must be a str, got {type(checkpoint_name).__name__}")
        if not re.fullmatch(r"[^/\\\x00]+", checkpoint_name) or checkpoint_name in (".", ".."):
            raise ValueError(f"checkpoint_name must be a file name inside the directory (no '/', not '..'), "
                             f"got {checkpoint_name!r}")
        hours = keep_checkpoint_every_n_hours
        if hours is not None:
            if isinstance(hours, (bool, np.bool_)) or not isinstance(hours, numbers.Real):
                raise TypeError(f"keep_checkpoint_every_n_hours must be a positive number or None, "
                                f"got {type(hours).__name__}")
            if not float(hours) > 0:  # NaN too
                raise ValueError(f"keep_checkpoint_every_n_hours must be a positive number or None, got {hours!r}")
        checkpoint_interval = _positive_int_or_none(checkpoint_interval, "checkpoint_interval")
        if checkpoint_interval is not None:
            if step_counter is None:
                raise ValueError("checkpoint_interval needs step_counter (a scalar int variable, such as "
                                 "optimizer.iterations) to count steps by")
            _step_of(step_counter)  # refuses what is not a scalar int
        if init_fn is not None and not callable(init_fn):
            raise TypeError(f"init_fn must be callable or None, got {type(init_fn).__name__}")
        self._checkpoint = checkpoint
        self._fs, self._root = fsspec.core.url_to_fs(directory)
        self._url = directory.rstrip("/")
        self._name = checkpoint_name
        self._max_to_keep = max_to_keep
        self._keep_hours: float | None = None if hours is None else float(hours)
        self._step_counter = step_counter
        self._interval = checkpoint_interval
        self._last_step: int | None = None
        self._init_fn = init_fn
        # checkpoint path -> the functions its coordinator had finished when it was saved (see recovery)
        self._done_at: dict[str, Counter[int]] = {}
        # Counts the functions finished so far (handed down by ClusterCoordinator(checkpoint_manager=...)),
        # held weakly: a manager must not keep its coordinator alive.
        self._finished: Callable[[], Callable[[], Counter[int]] | None] = lambda: None
        preserved = [_written_at(self._fs, self._checkpoint_root(n)) for n in self._preserved()]
        self._last_preserved = max(preserved) if preserved else time.time() - 1.0

    @property
    def directory(self) -> str:
        return self._url

    @property
    def checkpoint(self) -> Checkpoint:
        """The checkpoint this manager saves and restores."""
        return self._checkpoint

    def _checkpoint_root(self, n: int) -> str:
        return f"{self._root}/{self._name}-{n}"

    def _preserved(self) -> list[int]:
        return committed_numbers(self._fs, self._root, self._name, marker=PRESERVED)

    def _numbers(self) -> list[int]:
        """The managed checkpoints: committed ones, less those preserved for good."""
        kept = set(self._preserved()) if self._keep_hours is not None else set()
        return [n for n in committed_numbers(self._fs, self._root, self._name) if n not in kept]

    @property
    def checkpoints(self) -> list[str]:
        """Paths of the committed checkpoints, oldest first."""
        return [f"{self._url}/{self._name}-{n}" for n in self._numbers()]

    @property
    def latest_checkpoint(self) -> str | None:
        paths = self.checkpoints
        return paths[-1] if paths else None

    def save(self, checkpoint_number: int | None = None, check_interval: bool = True) -> str | None:
        """Write the next checkpoint, drop the oldest beyond ``max_to_keep``; return its path.

        With ``checkpoint_interval``: returns ``None`` without writing when
        ``step_counter`` has not moved since the last save, or (with
        ``check_interval``) moved by less than the interval.
        """
        if checkpoint_number is not None and (isinstance(checkpoint_number, bool) or not isinstance(
                checkpoint_number, (int, np.integer)) or checkpoint_number < 0):
            raise ValueError(f"checkpoint_number must be a non-negative int or None, got {checkpoint_number!r}")
        if self._interval is not None:
            step = _step_of(self._step_counter)
            if self._last_step is not None and (
                    step == self._last_step or (check_interval and step < self._last_step + self._interval)):
                return None
            self._last_step = step
        numbers = self._numbers()
        if checkpoint_number is None:
            checkpoint_number = max([self._checkpoint.save_counter, *numbers]) + 1
        self._checkpoint.save_counter = int(checkpoint_number)
        count = self._finished()
        done = None if count is None else count()
        path = self._checkpoint.write(f"{self._url}/{self._name}-{checkpoint_number}")
        if done is not None:
            self._done_at[path] = done
        if self._max_to_keep is not None:
            for n in self._numbers()[: -self._max_to_keep]:
                written = _written_at(self._fs, self._checkpoint_root(n))
                if self._keep_hours is not None and written - self._last_preserved >= 3600 * self._keep_hours:
                    self._fs.pipe_file(f"{self._checkpoint_root(n)}/{PRESERVED}", b"")  # kept for good
                    self._last_preserved = written
                else:
                    self._fs.rm(self._checkpoint_root(n), recursive=True)
        if len(self._done_at) > 1:
            kept = set(self.checkpoints)
            self._done_at = {p: n for p, n in self._done_at.items() if p in kept}
        return path

    def count_finished_with(self, count: Callable[[], Counter[int]]) -> None:
        """Note at each save what ``count()`` says has finished (a coordinator's functions, by the
        generation of servers their trainer knew); a recovery reads it back with :meth:`finished_at`.

        ``count`` is held weakly if it is a bound method.
        """
        if inspect.ismethod(count):
            ref = weakref.WeakMethod(count)
            self._finished = ref
        else:
            self._finished = lambda: count

    def finished_at(self, path: str) -> Counter[int] | None:
        """What the counter handed to :meth:`count_finished_with` said when ``path`` was saved."""
        return self._done_at.get(path)

    def restore_or_initialize(self) -> str | None:
        """Restore the latest checkpoint and return its path; else call ``init_fn`` and return None."""
        latest = self.latest_checkpoint
        if latest is not None:
            self._checkpoint.restore(latest)
            return latest
        if self._init_fn is not None:
            self._init_fn()
        return None

    def __repr__(self) -> str:
        return f"<daskps.CheckpointManager {self._url!r} checkpoints={len(self._numbers())}>"
