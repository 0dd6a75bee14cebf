"""``compare.py``'s runner for TorchRec: the ``dlrm`` workload on ``DistributedModelParallel``.

Two processes (one per trainer, as many as daskps' trainers) join a gloo
process group on loopback only: they meet through a file store (the default
TCP store listens on every interface) and gloo is bound to ``lo``
(``GLOO_SOCKET_IFNAME``). The DLRM is ``torchrec.models.dlrm.DLRM`` with
an ``EmbeddingBagCollection`` of the 8 tables (mean pooling), sharded by
TorchRec's planner, with FBGEMM's fused row-wise Adagrad applied in the
backward pass (``apply_optimizer_in_backward``) and ``torch.optim.Adagrad``
on the dense layers (kept in step by DDP). Each process trains on its own
batches, in lock step; the rate is all examples over the slower process's
time. The dense layers start from the weights daskps starts from.

    pip install ".[compare]"   # then: pip uninstall -y fbgemm-gpu fbgemm-gpu-cpu &&
                               #       pip install --no-deps fbgemm-gpu-cpu==1.9.0
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time


def run_torchrec(workloads: list[str], num_ps: int, num_workers: int, steps: dict[str, int]) -> dict[str, float]:
    if "dlrm" not in workloads:
        return {}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = f"file://{tmp}/store"
        procs = [ctx.Process(target=_rank, args=(r, num_workers, store, steps["dlrm"], queue))
                 for r in range(num_workers)]
        for p in procs:
            p.start()
        try:
            results = [queue.get(timeout=600) for _ in procs]
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.terminate()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(errors[0])
    seconds = max(r["seconds"] for r in results)
    examples = sum(r["examples"] for r in results)
    auc = next(r["auc"] for r in results if "auc" in r)
    return {"dlrm": examples / seconds, "dlrm_auc": auc}


def _rank(rank: int, world: int, store: str, steps: int, queue) -> None:
    try:
        queue.put(_train(rank, world, store, steps))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback

        queue.put({"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"})


def _train(rank: int, world: int, store: str, steps: int) -> dict:
    os.environ.update(GLOO_SOCKET_IFNAME="lo")
    import _dlrm
    import numpy as np
    import torch
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.models.dlrm import DLRM
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    # One thread per process, as torchrun sets OMP_NUM_THREADS for several processes per machine (torch's
    # own default, a thread per core in each process, ran 5x slower here: 2 processes on 2 cores).
    torch.set_num_threads(int(os.environ.get("DASKPS_BENCH_TORCH_THREADS", "1")))
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=store)
    n = steps * _dlrm.BATCH
    train, test = _dlrm.make_data(n)
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t{t}", embedding_dim=_dlrm.DIM, num_embeddings=_dlrm.ROWS,
                           feature_names=[f"f{t}"], pooling=PoolingType.MEAN) for t in range(_dlrm.TABLES)],
        device=torch.device("meta"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=_dlrm.DENSE,
                 dense_arch_layer_sizes=list(_dlrm.BOTTOM[1:]), over_arch_layer_sizes=list(_dlrm.TOP[1:]))
    init = _dlrm.init_params(1)
    linears = [m for m in model.dense_arch.modules() if isinstance(m, torch.nn.Linear)] + [
        m for m in model.over_arch.modules() if isinstance(m, torch.nn.Linear)]
    names = [("bottom0", "bottom1", "top0", "top1")[i] for i in range(len(linears))]
    with torch.no_grad():
        for m, name in zip(linears, names):
            m.weight.copy_(torch.from_numpy(init[f"{name}/w"].T))
            m.bias.copy_(torch.from_numpy(init[f"{name}/b"]))
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": _dlrm.LR})
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"))
    plan = planner.collective_plan(model, None, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(module=model, device=torch.device("cpu"), plan=plan)
    dense_opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                      lambda params: torch.optim.Adagrad(params, lr=_dlrm.LR))
    opt = CombinedOptimizer([dense_opt, dmp.fused_optimizer])
    loss_fn = torch.nn.BCEWithLogitsLoss()
    keys = [f"f{t}" for t in range(_dlrm.TABLES)]

    def kjt(bags) -> KeyedJaggedTensor:
        return KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.from_numpy(np.concatenate([v for v, _ in bags])),
            lengths=torch.from_numpy(np.concatenate([ln for _, ln in bags]).astype(np.int32)))

    mine = _dlrm.trainer_batches(train, rank, world)[: steps // world]
    warmup = 10
    start = None
    for i, b in enumerate(mine):
        if i == warmup:
            dist.barrier()
            start = time.perf_counter()
        x, bags, y = train.batch(b, b + _dlrm.BATCH)
        logits = dmp(torch.from_numpy(x), kjt(bags))
        loss = loss_fn(logits.squeeze(1), torch.from_numpy(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
    seconds = time.perf_counter() - start
    # Held-out AUC: each process scores its half of the test set; process 0 gathers the logits.
    dmp.eval()
    share = len(test) // world
    logits = []
    with torch.no_grad():
        for a in range(rank * share, (rank + 1) * share, _dlrm.BATCH):
            x, bags, _ = test.batch(a, a + _dlrm.BATCH)
            logits.append(dmp(torch.from_numpy(x), kjt(bags)).squeeze(1))
    mine_logits = torch.cat(logits)
    gathered = [torch.zeros_like(mine_logits) for _ in range(world)]
    dist.all_gather(gathered, mine_logits)
    out = {"seconds": seconds, "examples": (len(mine) - warmup) * _dlrm.BATCH}
    if rank == 0:
        scores = torch.cat(gathered).numpy()
        out["auc"] = _dlrm.auc(test.labels[: len(scores)], scores)
    dist.destroy_process_group()
    return out
