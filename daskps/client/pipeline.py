"""Pushes held back until the next message to their server: one step's push rides with the next step's reads.

Inside a batch of scheduled functions on a trainer (see
:mod:`daskps.trainer.batches`), updates and gradient pushes do not wait
for a reply of their own: :mod:`daskps.client.protocol` queues them per server
and sends them at the front of the next message to that server (usually the
next step's reads), or when the batch flushes. A server runs a message's
operations in order, so a read still sees every earlier push of this
trainer, and everything that completed before it was issued.

A function counts as finished only when every push it queued has been
acknowledged (:meth:`Pipeline.settled`); its result is reported then, so
TensorFlow's meaning of a finished function (its updates are applied) holds.

With bounded staleness (``schedule(..., staleness=k)``, ``k > 0``) a
function does not wait: it is reported as soon as it returns (*eager*), its
pushes ride with a later message (at most ``k`` of this trainer's steps
later), and its whole-value reads may be served from values this trainer
read at most ``k`` steps before in the same batch (:class:`StaleReads`). The last
function of a batch still waits for every push, so ``join()`` still means
every push is applied; an error a push of an eager function meets is
reported with the next function that reports.

The contract, all of it here: held pushes go first in their server's next
message, behind an ``Isolate(n)`` so that each succeeds or fails on its
own (:meth:`Pipeline.take`); once that message is answered, or fails,
:meth:`Pipeline.acknowledge` records each push's outcome against the
function that queued it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from typing import Any, cast

import numpy as np

from daskps._core import trace
from daskps._core.bags import BagGrad
from daskps._core.updates import Refused
from daskps.errors import PartlyAppliedError
from daskps.server import ops

_CURRENT: contextvars.ContextVar[Pipeline | None] = contextvars.ContextVar("daskps_pipeline", default=None)


class Pipeline:
    """The held-back pushes of one trainer thread, by server, and which function queued them."""

    def __init__(self) -> None:
        self.function: int | None = None  # the function running now
        self.pending: dict[Any, list[ops.Op]] = {}
        self.owners: dict[Any, list[int]] = {}  # server -> the function that queued each pending push
        self.taken: dict[Any, list[int]] = {}  # the same, for pushes sent and not yet acknowledged
        self.errors: dict[int, BaseException] = {}
        self.staleness = 0  # of the function running now
        self.eager: set[int] = set()  # functions reported without waiting for their pushes
        self.reported_early: set[int] = set()  # eager functions already reported
        self.held_since: int | None = None  # the step when the oldest pending push was queued
        self.reads = StaleReads()  # this batch's steps and the values they read (bounded staleness)
        # The generation of re-created servers the running function knew as it began (None: not known):
        # it reaches those servers, even where this process learns of newer ones while it runs.
        self.generation: int | None = None

    def defer(self, server: Any, op: ops.Op, merge: bool = False) -> None:
        """Hold ``op`` for ``server``; its arrays are copied now (the caller may reuse its buffers).

        ``merge`` (gradients of an optimizer whose steps add up, e.g. SGD
        without momentum): under bounded staleness, a function that reports
        without waiting adds its dense gradients into the same push held for
        this server by an earlier such function, when that push names the
        same variables; the server then applies the sum once, as it would
        have applied each in turn, and counts every step it holds.
        """
        held = self.pending.get(server)
        if merge and self.staleness and self.function in self.eager and held:
            last, owner = held[-1], self.owners[server][-1]
            if (isinstance(last, ops.ApplyGradients) and isinstance(op, ops.ApplyGradients) and _mergeable(last, op)
                    and (owner in self.eager or owner in self.reported_early)):
                for (_, _, into), (_, _, grad) in zip(last.items, op.items):
                    held_grad = cast(np.ndarray, into)  # both arrays (checked); this pipeline's own copy
                    np.add(held_grad, cast(np.ndarray, grad), out=held_grad)
                held[-1] = last._replace(times=last.times + 1)
                return
        started = trace.now() if trace.ON else 0.0
        self.pending.setdefault(server, []).append(_copied(op))
        if trace.ON:
            trace.span("hold", started)
        self.owners.setdefault(server, []).append(self.function)  # type: ignore[arg-type]
        if self.held_since is None:
            self.held_since = self.reads.step

    def held_too_long(self) -> bool:
        """Whether the oldest pending push was queued more than ``staleness`` steps ago (then it goes now).

        Reads served from :attr:`reads` send nothing: the held pushes would otherwise wait
        for the next read that does go out, ``staleness + 1`` steps after the last one.
        """
        return self.held_since is not None and self.reads.step - self.held_since > self.staleness

    def start(self, function: int, staleness: int, eager: bool) -> None:
        """Function ``function`` starts: a new step; ``eager``: it reports without waiting for its pushes."""
        self.function, self.staleness = function, staleness
        self.reads.step += 1
        if eager:
            self.eager.add(function)

    def take(self, servers: Iterable[Any]) -> dict[Any, list[ops.Op]]:
        """The pushes held for ``servers``, to send now: each server's message starts with these."""
        out: dict[Any, list[ops.Op]] = {}
        for s in list(servers):
            if s in self.pending:
                held = self.pending.pop(s)
                out[s] = [ops.Isolate(len(held)), *held]
                self.taken[s] = self.owners.pop(s)
        if not self.pending:
            self.held_since = None
        return out

    def acknowledge(self, answers: dict[Any, Any], error: BaseException | None = None) -> None:
        """The messages carrying the taken pushes were answered (``answers``: results or exception, by server).

        A server's results hold a ``Refused`` for each push it refused; a
        :class:`PartlyAppliedError` says the same of a message that failed
        later on. Where the answer is missing or another error, ``error``
        (or that error) is what became of all its pushes.
        """
        for server in list(self.taken):
            got = answers.get(server)
            if isinstance(got, list):
                outcomes: list | None = got[1 : 1 + len(self.taken[server])]
            elif isinstance(got, PartlyAppliedError):
                outcomes = got.outcomes
            else:
                outcomes = None
            failed = got if isinstance(got, BaseException) else error
            for i, function in enumerate(self.taken.pop(server)):
                refused = outcomes[i] if outcomes is not None else None
                why = refused.error if isinstance(refused, Refused) else (failed if outcomes is None else None)
                if why is not None:
                    self.errors.setdefault(function, why)

    def settled(self, function: int) -> bool:
        """Whether ``function`` can be reported: every push it queued was acknowledged, or it is eager."""
        return function in self.eager or not any(function in fs for fs in (*self.owners.values(),
                                                                           *self.taken.values()))

    def error_for(self, function: int) -> BaseException | None:
        """The error to report with ``function``: one of its pushes met, else one a push of an eager
        function already reported met (that function's report has gone out)."""
        if function in self.eager:
            self.eager.discard(function)
            self.reported_early.add(function)
        found = self.errors.get(function)
        for early in [f for f in self.errors if f in self.reported_early][:1]:
            found = found or self.errors[early]
            self.errors.setdefault(function, self.errors.pop(early))  # now this function's: the batch stops
        return found


class StaleReads:
    """This batch's steps on the trainer, and the whole values they read, with the step of each read.

    A value read at step ``s`` may serve reads up to step ``s + k`` of a
    function scheduled with ``staleness=k``. An update this trainer makes to
    a variable (``assign`` and the like) drops its value here; gradient
    pushes do not (that is what the mode allows). One per batch: nothing
    outlives the batch, so a trainer holds no copies once it is idle.
    """

    def __init__(self) -> None:
        self.step = 0
        self.values: dict[str, tuple[np.ndarray, int]] = {}  # key -> (value, step it was read at)

    def get(self, key: str, staleness: int) -> np.ndarray | None:
        """A copy of ``key``'s value if it was read at most ``staleness`` steps ago."""
        found = self.values.get(key)
        if found is None or self.step - found[1] > staleness:
            return None
        return found[0].copy()

    def keep(self, key: str, value: np.ndarray) -> None:
        self.values[key] = (value.copy(), self.step)

    def forget(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.values.pop(key, None)


def current() -> Pipeline | None:
    """The pipeline of the batch running in this thread, if any."""
    return _CURRENT.get()


@contextlib.contextmanager
def pipelined() -> Iterator[Pipeline]:
    """Hold pushes back inside this block (the caller flushes before leaving)."""
    pipe = Pipeline()
    token = _CURRENT.set(pipe)
    try:
        yield pipe
    finally:
        _CURRENT.reset(token)


def _mergeable(held: ops.ApplyGradients, op: ops.ApplyGradients) -> bool:
    """Whether gradient push ``op`` can be added into ``held``: the same optimizer, counter and dense variables."""
    if held.opt_key != op.opt_key or held.bump != op.bump or len(held.items) != len(op.items):
        return False
    for (key, kind, into), (key2, kind2, grad) in zip(held.items, op.items):
        if (key != key2 or kind != "dense" or kind2 != "dense" or type(into) is not np.ndarray
                or type(grad) is not np.ndarray or into.shape != grad.shape or into.dtype != grad.dtype):
            return False
    return True


def _copied(obj: Any) -> Any:
    """``obj`` with every numpy array in it (through lists, tuples and dicts) copied.

    A :class:`BagGrad` is kept as it is: its arrays are made for it, or kept by
    a ``Bags`` that never changes them.
    """
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if type(obj) is BagGrad:
        return obj
    if isinstance(obj, (list, tuple)):
        items = [_copied(x) for x in obj]
        return type(obj)(items) if type(obj) in (list, tuple) else type(obj)(*items)
    if isinstance(obj, dict):
        return {k: _copied(v) for k, v in obj.items()}
    return obj
