"""``dps.torch.EmbeddingBag``: torch's EmbeddingBag with its table on the parameter servers.

The reference is ``torch.nn.EmbeddingBag`` itself, trained by ``torch.optim.SGD`` beside the same head.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import daskps as dps  # noqa: E402
import daskps.torch  # noqa: E402,F401


def _data(rng):
    ids = torch.from_numpy(rng.integers(0, 50, size=30))
    offsets = torch.tensor([0, 4, 4, 10, 17, 23, 27])  # bag 1 empty
    y = torch.from_numpy(rng.normal(size=(7, 1)).astype(np.float32))
    return ids, offsets, y


@pytest.mark.parametrize("mode", ["mean", "sum"])
def test_trains_as_torch_embedding_bag(strategy, mode):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    init = rng.normal(size=(50, 6)).astype(np.float32)
    reference = torch.nn.EmbeddingBag(50, 6, mode=mode)
    with torch.no_grad():
        reference.weight.copy_(torch.from_numpy(init))
    head_ref = torch.nn.Linear(6, 1)
    head = torch.nn.Linear(6, 1)
    head.load_state_dict(head_ref.state_dict())
    with strategy.scope():
        table = dps.Variable(init, name="torch_bag")
        opt = dps.optimizers.SGD(0.1)
    bag = dps.torch.EmbeddingBag(table, opt, combiner=mode)
    torch_opt = torch.optim.SGD(list(reference.parameters()) + list(head_ref.parameters()), lr=0.1)
    head_opt = torch.optim.SGD(head.parameters(), lr=0.1)
    for _ in range(3):
        ids, offsets, y = _data(rng)
        torch_opt.zero_grad()
        loss_ref = torch.nn.functional.mse_loss(head_ref(reference(ids, offsets)), y)
        loss_ref.backward()
        torch_opt.step()
        head_opt.zero_grad()
        loss = torch.nn.functional.mse_loss(head(bag(ids, offsets)), y)
        loss.backward()  # the table's gradient goes to its server here
        head_opt.step()
        np.testing.assert_allclose(loss.item(), loss_ref.item(), rtol=1e-5)
    np.testing.assert_allclose(table.numpy(), reference.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # no gradient: a plain lookup
        out = bag(torch.tensor([[1, 2], [3, -1]]))
    assert not out.requires_grad
    np.testing.assert_allclose(out.numpy(), [table.numpy()[[1, 2]].mean(0) if mode == "mean" else
                                             table.numpy()[[1, 2]].sum(0), table.numpy()[3]], rtol=1e-6)


def test_bad_arguments_are_refused_by_name(strategy):
    with strategy.scope():
        table = dps.Variable(np.zeros((5, 2), np.float32), name="torch_bad")
        opt = dps.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match="combiner must be one of"):
        dps.torch.EmbeddingBag(table, opt, combiner="max")
    with pytest.raises(TypeError, match="optimizer must be a daskps optimizer"):
        dps.torch.EmbeddingBag(table, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    bag = dps.torch.EmbeddingBag(table, opt)
    with pytest.raises(ValueError, match="offsets must be given"):
        bag(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="offsets must be a 1-D, non-decreasing"):
        bag(torch.tensor([1, 2]), offsets=torch.tensor([1]))
    with pytest.raises(ValueError, match="offsets must be None when input is 2-D"):
        bag(torch.tensor([[1, 2]]), offsets=torch.tensor([0]))
    np.testing.assert_array_equal(table.numpy(), np.zeros((5, 2)))
