"""PyTorch modules over parameter-server tables: ``dps.torch.EmbeddingBag``.

``EmbeddingBag`` is ``torch.nn.EmbeddingBag`` whose table lives on the
parameter servers: the forward pass pools each bag there
(:func:`daskps.embedding_lookup_sparse`) and the backward pass sends the
gradient of the pooled vectors back (one vector per bag,
:class:`daskps.PooledSlices`) through a daskps optimizer. The module holds
no parameters: ``torch.optim`` optimizers train the rest of the model.
Needs PyTorch (``pip install ".[torch]"``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from daskps.variables.bags import COMBINERS, Bags, PooledSlices, embedding_lookup_sparse

__all__ = ["EmbeddingBag"]


class _Pool(torch.autograd.Function):
    """The pooled vectors of ``bags``; their gradient goes to the servers in the backward pass."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, module: EmbeddingBag, bags: Bags) -> torch.Tensor:
        ctx.module, ctx.bags = module, bags
        return torch.from_numpy(np.ascontiguousarray(embedding_lookup_sparse(module.table, bags)))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        module = ctx.module
        module.optimizer.apply_gradients([(PooledSlices(grad.detach().cpu().numpy(), ctx.bags), module.table)])
        return None, None, None


class EmbeddingBag(torch.nn.Module):
    """``torch.nn.EmbeddingBag`` over a table on the parameter servers, pooled there.

    Parameters
    ----------
    table : Variable, ShardedVariable or EmbeddingTable
        The rows, on the servers.
    optimizer : a daskps optimizer
        Applies the table's gradient, on the servers, when ``backward`` reaches this module.
    combiner : {"mean", "sum", "sqrtn"}
        As ``mode`` of ``torch.nn.EmbeddingBag`` ("sqrtn" divides by the
        root of the sum of squared weights, as TensorFlow does).
    max_norm, default_id
        As :func:`daskps.embedding_lookup_sparse`.

    ``forward(input, offsets=None, per_sample_weights=None)`` takes what
    ``torch.nn.EmbeddingBag`` takes: a 2-D ``input`` (a bag per row), or a
    1-D ``input`` with ``offsets`` (where each bag starts); or a
    :class:`daskps.Bags`. Ids < 0 are dropped (padding), as TensorFlow's
    ``safe_embedding_lookup_sparse`` drops them; an empty bag gives zeros
    (or ``default_id``'s row). It returns a float tensor of shape
    ``(bags, dim)`` that takes part in autograd.

    Examples
    --------
    >>> bag = dps.torch.EmbeddingBag(table, optimizer)                      # doctest: +SKIP
    >>> out = head(bag(torch.tensor([3, 1, 7]), offsets=torch.tensor([0, 2])))  # doctest: +SKIP
    >>> out.sum().backward()   # the table's gradient goes to its servers   # doctest: +SKIP
    """

    def __init__(self, table: Any, optimizer: Any, *, combiner: str = "mean", max_norm: float | None = None,
                 default_id: int | None = None):
        super().__init__()
        if combiner not in COMBINERS:
            raise ValueError(f"combiner must be one of {COMBINERS}, got {combiner!r}")
        if not callable(getattr(optimizer, "apply_gradients", None)):
            raise TypeError(f"optimizer must be a daskps optimizer, got {type(optimizer).__name__}")
        self.table, self.optimizer = table, optimizer
        self.combiner, self.max_norm, self.default_id = combiner, max_norm, default_id
        # Lets the output take part in autograd (the module has no parameter of its own).
        self._anchor = torch.zeros((), requires_grad=True)

    def bags(self, input: Any, offsets: Any = None, per_sample_weights: Any = None) -> Bags:
        """The :class:`daskps.Bags` of a ``forward`` call's arguments."""
        if isinstance(input, Bags):
            if offsets is not None or per_sample_weights is not None:
                raise ValueError("input is a dps.Bags: leave offsets and per_sample_weights unset")
            return input
        ids = np.asarray(input.detach().cpu().numpy() if isinstance(input, torch.Tensor) else input)
        weights = None if per_sample_weights is None else np.asarray(
            per_sample_weights.detach().cpu().numpy() if isinstance(per_sample_weights, torch.Tensor)
            else per_sample_weights).reshape(-1)
        if ids.ndim == 2:
            if offsets is not None:
                raise ValueError(f"offsets must be None when input is 2-D (a bag per row), got {offsets!r}")
            lengths = np.full(ids.shape[0], ids.shape[1])
        elif ids.ndim == 1:
            if offsets is None:
                raise ValueError("offsets must be given when input is 1-D (where each bag starts)")
            starts = np.asarray(offsets.detach().cpu().numpy() if isinstance(offsets, torch.Tensor) else offsets)
            if starts.ndim != 1 or (len(starts) and (starts[0] != 0 or np.any(np.diff(starts) < 0)
                                                     or starts[-1] > len(ids))):
                raise ValueError("offsets must be a 1-D, non-decreasing sequence starting at 0 and within input, "
                                 f"got {starts!r}")
            lengths = np.diff(np.append(starts, len(ids)))
        else:
            raise ValueError(f"input must be 1-D (with offsets) or 2-D, got shape {ids.shape}")
        return Bags((ids.reshape(-1), lengths), weights, combiner=self.combiner, max_norm=self.max_norm,
                    default_id=self.default_id)

    def forward(self, input: Any, offsets: Any = None, per_sample_weights: Any = None) -> torch.Tensor:
        bags = self.bags(input, offsets, per_sample_weights)
        if not torch.is_grad_enabled():
            return torch.from_numpy(np.ascontiguousarray(embedding_lookup_sparse(self.table, bags)))
        return _Pool.apply(self._anchor, self, bags)

    def extra_repr(self) -> str:
        return f"table={getattr(self.table, 'name', self.table)!r}, combiner={self.combiner!r}"
