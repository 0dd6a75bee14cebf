"""Checkpoints written by the parameter servers themselves, committed by a manifest: writing and reading.

``Checkpoint(**objects)`` names every tensor by its path among the objects
(``model/w``, ``opt/iterations``, ``w/.OPTIMIZER_SLOT/opt/m``). On save each
server writes the pieces it holds, straight to the fsspec path, all servers
at once; the coordinator then writes ``manifest.json`` (to a temporary name,
then renamed), which is the commit point: a save that dies before it leaves
no checkpoint, and the previous one untouched.

Dict keys are escaped as TensorFlow does (``.`` -> ``..``, ``/`` -> ``.S``),
so ``{"dense/kernel": w}`` is one tensor, not a nesting.

A sharded variable is one tensor stored in pieces; a restore reads, for each
shard, just the rows it needs, so it works into any number of shards (or a
plain variable), and optimizer slots follow their variable. A restore first
checks every name, shape and dtype, then has every server read its part,
and only when all reads succeeded do they put the values in place.

>>> import daskps as dps, tempfile
>>> w = dps.Variable([1.0, 2.0])
>>> ckpt = dps.Checkpoint(model={"w": w})
>>> path = ckpt.save(tempfile.mkdtemp() + "/ckpt")
>>> _ = w.assign([0.0, 0.0])
>>> _ = ckpt.restore(path)
>>> w.numpy()
array([1., 2.], dtype=float32)
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import distributed
import fsspec

from daskps._core import ckpt_io, views
from daskps._core.config import setting
from daskps.client import protocol
from daskps.scheduler.messages import CHECKPOINT_TOPIC
from daskps.server.ops import SAVED_TENSORS, HashRestoreSpec
from daskps.training.manifest import (
    MANIFEST,
    TableTensor,
    Tensor,
    check_match,
    check_optimizers_reach,
    checked_manifest,
    collect,
    renumber,
    saved_rows,
    saved_slots,
    slot_index,
    tensors_of,
)

__all__ = ["Checkpoint"]


class _LoadStatus:
    """What ``restore`` returns; a restore that returns has matched everything."""

    def assert_consumed(self) -> _LoadStatus:
        return self

    assert_existing_objects_matched = expect_partial = assert_consumed


class Checkpoint:
    """Save and restore variables, sharded variables, optimizers and metrics.

    Parameters
    ----------
    **objects
        Named objects, or dicts/lists/tuples of them, nested as you like.
    """

    def __init__(self, **objects: Any):
        collect(objects)  # refuse unsupported objects now
        self._objects = objects
        self.save_counter = 0

    @property
    def objects(self) -> dict[str, Any]:
        """The named objects it saves and restores, as given (a new dict)."""
        return dict(self._objects)

    # -- saving -----------------------------------------------------------------
    def save(self, file_prefix: str, progress: bool | None = None) -> str:
        """Write to ``f"{file_prefix}-{n}"`` with ``n = save_counter + 1``; return that path."""
        path = f"{file_prefix}-{self.save_counter + 1}"
        self.save_counter += 1
        return self.write(path, progress)

    def write(self, path: str, progress: bool | None = None) -> str:
        """Write a checkpoint to ``path`` (an fsspec URL or local directory); return it.

        ``progress`` shows the bytes written as the servers write them;
        ``None`` shows it for models of ``daskps.progress-bytes`` (256 MiB) or more.
        """
        started = time.monotonic()
        fs, root = fsspec.core.url_to_fs(path)
        _clear(fs, root, path)
        tensors, optimizers = collect(self._objects)
        items = []
        for name, t in tensors.items():
            opts = [(p, o.server_key) for p, o in optimizers.items()] if t.slotted else []
            items += [(v.handle, name, offset, opts) for v, offset in t.parts]
        nbytes = sum(v.nbytes for t in tensors.values() for v, _ in t.parts)
        show = progress if progress is not None else nbytes >= setting("progress_bytes")
        run = lambda: protocol.save(path, items)  # noqa: E731
        records = _with_progress(run, f"saving {path}", nbytes, fs, root) if show else run()
        saved = tensors_of(records)
        tables = [name for name, t in tensors.items() if isinstance(t, TableTensor)]
        renumber(saved, tables)
        for name in tables:
            saved[name]["kind"] = "hash"  # rows by key: not a dense variable's rows
        for name, t in tensors.items():
            if isinstance(t, Tensor) and t.layout == "mod":  # the variable's pieces and its slots'
                for tensor, entry in saved.items():
                    if tensor == name or tensor.startswith(f"{name}/{ckpt_io.SLOT}/"):
                        entry["layout"] = ["mod", len(t.parts)]
        manifest = {"format": "daskps-checkpoint/1", "save_counter": self.save_counter, "time": time.time(),
                    "tensors": saved}
        fs.pipe_file(f"{root}/{MANIFEST}.tmp", json.dumps(manifest, indent=1).encode())
        fs.mv(f"{root}/{MANIFEST}.tmp", f"{root}/{MANIFEST}")  # the commit point
        owner = next((v.handle.owner for t in tensors.values() for v, _ in t.parts if v.handle.owner is not None),
                     None)
        _tell_scheduler(getattr(owner, "client", None), path, time.monotonic() - started, nbytes)
        return path

    # -- restoring --------------------------------------------------------------
    def restore(self, save_path: str) -> _LoadStatus:
        """Restore every object (and ``save_counter``) from ``save_path``, or change nothing."""
        manifest = self.restore_on(save_path)
        self.save_counter = int(manifest.get("save_counter", self.save_counter))
        return _LoadStatus()

    def read(self, save_path: str) -> _LoadStatus:
        """Like :meth:`restore`, leaving ``save_counter`` alone."""
        self.restore_on(save_path)
        return _LoadStatus()

    def restore_on(self, path: str, servers: Any = None) -> dict:
        """Restore from ``path``; return its manifest.

        With ``servers``, only the parts held on those servers are restored
        (a server re-created after a loss), and the tensors among them the
        checkpoint lacks are left as they are; the manifest then also has
        ``"restored"``: the tensors restored, by name.
        """
        fs, root = fsspec.core.url_to_fs(path)
        try:
            raw = fs.cat_file(f"{root}/{MANIFEST}")
        except FileNotFoundError:
            raise ValueError(f"no checkpoint at {path!r}: no {MANIFEST} (never written, or its save did not finish)") from None
        manifest = checked_manifest(raw, f"{path.rstrip('/')}/{MANIFEST}")
        tensors, optimizers = collect(self._objects)
        saved = manifest["tensors"]
        if servers is not None:
            tensors = {name: t for name, t in tensors.items() if name in saved
                       and any(v.handle.server in servers for v, _ in t.parts)}
        slots_of = slot_index(saved)
        check_match(tensors, saved, slots_of, path)
        check_optimizers_reach(tensors, optimizers, slots_of, path)
        items: list[tuple[Any, Any]] = []
        for name, t in tensors.items():
            if isinstance(t, TableTensor):  # every part reads the rows whose keys are now its own
                slots = {o.server_key: saved_slots(slots_of, saved[name], name, p) for p, o in optimizers.items()}
                spec = HashRestoreSpec({s: saved[name + s]["pieces"] for s in SAVED_TENSORS}, slots)
                items += [(part.handle, spec) for part, _ in t.parts
                          if servers is None or part.handle.server in servers]
                continue
            for i, (v, offset) in enumerate(t.parts):
                if servers is not None and v.handle.server not in servers:
                    continue
                stop = offset + (v.shape[0] if v.shape else 1)
                slots = ({o.server_key: saved_slots(slots_of, saved[name], name, p) for p, o in optimizers.items()}
                         if t.slotted else {})
                at = saved_rows(t, i, offset, stop, saved[name])
                items.append((v.handle, ckpt_io.RestoreSpec(offset, stop, saved[name]["pieces"], slots, at)))
        protocol.restore(path, items)
        manifest["restored"] = {name: [v.handle.key for v, _ in t.parts] for name, t in tensors.items()}
        return manifest

    def __repr__(self) -> str:
        return f"<daskps.Checkpoint {sorted(self._objects)} save_counter={self.save_counter}>"


def _with_progress(run: Callable[[], Any], label: str, nbytes: int, fs: Any, root: str) -> Any:
    """``run()`` in a thread while a bar shows the bytes that have reached ``root``."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["result"] = run()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=target, name="daskps-save", daemon=True)
    thread.start()
    views.watch_bytes(label, nbytes, lambda: fs.du(root), lambda: not thread.is_alive())
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


def _clear(fs: Any, root: str, path: str) -> None:
    """Empty ``root`` for a new checkpoint; refuse to touch anything that is not one."""
    if not fs.exists(root):
        fs.makedirs(root, exist_ok=True)
        return
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
    if any(not (n.endswith(".npy") or n.startswith(MANIFEST)) for n in names):
        raise ValueError(f"{path!r} exists and is not a daskps checkpoint; refusing to overwrite it")
    fs.rm(root, recursive=True)
    fs.makedirs(root, exist_ok=True)


def _tell_scheduler(client: Any, path: str, seconds: float, nbytes: int) -> None:
    """Tell the scheduler that a checkpoint was written (its /metrics counts them): the scheduler of
    ``client`` (the strategy's that holds the variables), else of this process's default client."""
    if client is None:
        try:
            client = distributed.default_client()
        except ValueError:  # no client in this process: nobody to tell
            return
    msg = {"path": path, "seconds": seconds, "bytes": int(nbytes)}
    with contextlib.suppress(Exception):  # sent on the client's loop, not waited for: a count must not slow a save
        client.loop.add_callback(_send_event, client, CHECKPOINT_TOPIC, msg)


async def _send_event(client: Any, topic: str, msg: dict) -> None:
    with contextlib.suppress(Exception):
        await client.scheduler.log_event(topic=topic, msg=msg)
