"""Meta-device models: build on meta, shard, ``to_empty``, initialize; equal to one device.

No rank allocates a whole tensor: meta tensors stay meta through ``distribute_tensor``, the
factories, ``distribute_module``, ``parallelize_module``, ``fully_shard`` and ``replicate``;
``to_empty`` gives each rank storage for its blocks in the same layout (Partial buffers
included), and ``init_weights`` fills them with layout-independent random numbers, so the
gathered parameters equal the single-device model's after the same seed. The trainer builds
its model this way; its first losses equal a one-process run of the model built whole.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.train import cli

LAYOUTS = {"fsdp": {"dp_shard": 4}, "tp": {"tp": 4}, "fsdp+tp": {"dp_shard": 2, "tp": 2}}


def _single_device(args, seed: int) -> dict[str, torch.Tensor]:
    from shardwise.tensor import random as sw_random
    from shardwise.train.models.llama import Transformer

    sw_random.manual_seed(seed)
    return {k: v.detach().clone() for k, v in Transformer(args).state_dict().items()}


def _model_equals_single_device(seed: int) -> dict:
    """Every layout, built on meta then initialized, against the model built whole on this rank."""
    from shardwise.tensor import random as sw_random
    from shardwise.tensor.dtensor import DTensor
    from shardwise.parallel.dims import ParallelDims
    from shardwise.train.models.llama import CONFIGS, build_llama
    from shardwise.train.parallelize import ParallelOptions

    args = CONFIGS["tiny"]
    want = _single_device(args, seed)
    out = {}
    for name, degrees in LAYOUTS.items():
        dims = ParallelDims(world_size=4, **{"dp_shard": 1, **degrees})
        mesh = dims.build_mesh()
        sw_random.manual_seed(seed)
        meta = build_llama(args, dims, mesh, ParallelOptions(), "cpu", materialize=False)
        # Meta: every block is a meta tensor of the block's shape; nothing was allocated.
        blocks_meta = all(
            p._local_tensor.is_meta and tuple(p._local_tensor.shape) == p._spec.local_shape()
            for p in meta.parameters() if isinstance(p, DTensor)
        )
        sw_random.manual_seed(seed)
        model = build_llama(args, dims, mesh, ParallelOptions(), "cpu")
        got = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}
        sharded = [k for k, v in model.state_dict().items() if isinstance(v, DTensor) and len(v.placements) > 0
                   and any(not p.is_replicate() for p in v.placements)]
        out[name] = {
            "blocks_meta": blocks_meta,
            "unequal": [k for k in want if not torch.equal(got[k], want[k])],
            "keys": sorted(got) == sorted(want),
            "sharded": len(sharded),
            "cpu": all(p.device.type == "cpu" for p in model.parameters()),
        }
    return out


def test_meta_built_model_equals_single_device_model_for_fsdp_tp_and_both(dist):
    results = dist.run(4, _model_equals_single_device, 11, timeout=180)
    for rank, per_layout in enumerate(results):
        for layout, r in per_layout.items():
            assert r["blocks_meta"], f"rank {rank} {layout}: a parameter block was allocated before to_empty"
            assert r["keys"] and r["cpu"], (rank, layout, r)
            assert r["sharded"] > 0, f"{layout}: nothing was sharded"
            assert not r["unequal"], f"rank {rank} {layout}: {r['unequal']} differ from the single-device model"


def _meta_apis(_: int) -> dict:
    """Each entry point on meta input: block shapes, devices and placements, before/after to_empty."""
    from torch import nn

    import shardwise
    from shardwise.tensor import random as sw_random
    from shardwise.tensor.factories import distribute_tensor
    from shardwise.debug import CommDebugMode
    from shardwise.tensor.dtensor import DTensor
    from shardwise.fsdp import fully_shard, replicate
    from shardwise.core.mesh import init_device_mesh
    from shardwise.tensor.distribute_module import distribute_module
    from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from shardwise.core.placement import Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (4,))
    out: dict = {}

    def layout(t: DTensor) -> tuple:
        return (t._local_tensor.device.type, tuple(t._local_tensor.shape), tuple(t.placements))

    before = sw_random.get_rng_state()
    with CommDebugMode() as comms:
        whole = torch.empty(10, 6, device="meta")
        out["distribute_tensor"] = [layout(distribute_tensor(whole, mesh, [p])) for p in (Shard(0), Replicate(), Partial())]
        out["from_local"] = layout(DTensor.from_local(torch.empty(3, 6, device="meta"), mesh, [Shard(0)]))
        out["factories"] = [layout(f(10, 6, device_mesh=mesh, placements=[Shard(1)], device="meta"))
                            for f in (shardwise.zeros, shardwise.ones, shardwise.empty, shardwise.rand, shardwise.randn)]
        out["full"] = layout(shardwise.full((10, 6), 2.0, device_mesh=mesh, placements=[Shard(0)], device="meta"))
        out["random_unmoved"] = sw_random.get_rng_state() == before

        def build() -> nn.Module:
            with torch.device("meta"):
                return nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 6))

        tp = parallelize_module(build(), mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
        dm = distribute_module(build(), mesh)
        dm.register_buffer("pending", distribute_tensor(torch.empty(6, device="meta"), mesh, [Partial()]))
        fs = build()
        fully_shard(fs[0], mesh=mesh)
        fully_shard(fs, mesh=mesh)
        rp = replicate(build(), mesh=mesh)
        models = {"parallelize_module": tp, "distribute_module": dm, "fully_shard": fs, "replicate": rp}
        out["meta"] = {k: [layout(p) for p in m.parameters()] for k, m in models.items()}
    out["meta_comms"] = comms.get_total_counts()

    # Forward before to_empty: one clear error on every rank, nothing communicated.
    errors = {}
    for name in ("fully_shard", "replicate"):
        try:
            models[name](torch.ones(2, 6))
        except RuntimeError as err:
            errors[name] = str(err)
    # to_empty onto a device the mesh does not cover. On a CPU-only torch build, torch's argument
    # parser refuses "cuda" before dispatch; the op to_empty reaches is checked directly too.
    try:
        tp.to_empty(device="cuda")
    except (ValueError, AssertionError, RuntimeError) as err:
        errors["to_empty"] = str(err)
    try:
        torch.ops.aten.empty_like.default(tp[0].weight, device=torch.device("cuda"))
    except ValueError as err:
        errors["empty_like"] = str(err)
    out["errors"] = errors

    x = torch.linspace(-1.0, 1.0, 12).reshape(2, 6)  # the same batch on every rank: averaged grads = local
    for name, m in models.items():
        m.to_empty(device="cpu")
        sw_random.manual_seed(5)
        for sub in m.modules():
            if isinstance(sub, nn.Linear):
                sub.reset_parameters()
    out["after"] = {k: [layout(p) for p in m.parameters()] for k, m in models.items()}
    out["buffer"] = layout(dm.pending)
    # The same Linear layers initialized whole on one device after the same seed.
    sw_random.manual_seed(5)
    ref = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 6))
    with sw_random.layout_independent():
        for sub in ref:
            sub.reset_parameters()
    want = [p.detach() for p in ref.parameters()]
    out["equal"] = {k: all(torch.equal(p.full_tensor(), w) for p, w in zip(m.parameters(), want)) for k, m in models.items()}
    y = ref(x)
    y.sum().backward()
    ref_grads = [p.grad for p in ref.parameters()]
    fits = {}
    for name in ("fully_shard", "replicate"):
        m = models[name]
        got = m(x)
        got.sum().backward()
        fits[name] = torch.allclose(got, y, atol=1e-6) and all(
            torch.allclose(p.grad.full_tensor(), g, atol=1e-6) for p, g in zip(m.parameters(), ref_grads))
    out["train"] = fits
    return out


def test_meta_tensors_stay_meta_and_to_empty_gives_each_rank_its_block(dist):
    results = dist.run(4, _meta_apis, 0, timeout=180)
    for rank, r in enumerate(results):
        rows = 1 if rank == 3 else 3  # torch.chunk of 10 rows over 4 ranks: 3, 3, 3, 1
        shapes = [s for _, s, _ in r["distribute_tensor"]]
        assert all(d == "meta" for d, _, _ in r["distribute_tensor"])
        assert shapes == [(rows, 6), (10, 6), (10, 6)], shapes
        assert r["from_local"][:2] == ("meta", (3, 6))
        cols = 2 if rank < 3 else 0  # 6 columns over 4 ranks: 2, 2, 2, 0
        assert r["factories"] == [("meta", (10, cols), r["factories"][0][2])] * 5
        assert r["full"][:2] == ("meta", (rows, 6))
        assert r["random_unmoved"], "meta random factories consumed random numbers"
        assert r["meta_comms"] == 0, "building on meta communicated"
        for name, params in r["meta"].items():
            assert all(d == "meta" for d, _, _ in params), (name, params)
            assert [p for _, _, p in params] == [p for _, _, p in r["after"][name]], f"{name}: placements changed"
            assert all(d == "cpu" for d, _, _ in r["after"][name]), (name, r["after"][name])
            assert [s for _, s, _ in params] == [s for _, s, _ in r["after"][name]], f"{name}: block shapes changed"
        assert r["buffer"] == ("cpu", (6,), r["buffer"][2]) and "Partial" in str(r["buffer"][2]), r["buffer"]
        assert "meta device" in r["errors"]["fully_shard"] and "'1.weight'" in r["errors"]["fully_shard"]
        assert "meta device" in r["errors"]["replicate"]
        assert "device='cuda'" in r["errors"]["empty_like"] and "mesh(dim0=4)" in r["errors"]["empty_like"]
        assert r["errors"]["to_empty"] in (r["errors"]["empty_like"], "Torch not compiled with CUDA enabled")
        assert all(r["equal"].values()), r["equal"]
        assert all(r["train"].values()), r["train"]


# ---------------------------------------------------------------------- the trainer
DEBUG = ["--config", "debug", "--steps", "5", "--global-batch", "4", "--seq-len", "32", "--lr", "3e-3",
         "--warmup", "2", "--seed", "3", "--log-every", "1000"]


def _built_on_meta(job, runtime):
    """The debug model built on meta, parallelized, then ``to_empty`` + ``init_weights``."""
    from shardwise.tensor import random as sw_random
    from shardwise.train.models.llama import Transformer
    from shardwise.train.models.llama import parallelize_llama
    from shardwise.train.parallelize import ParallelOptions

    sw_random.manual_seed(job.seed)
    with torch.device("meta"):
        model = Transformer(job.model_args())
    parallelize_llama(model, runtime.dims, runtime.world_mesh, ParallelOptions())
    assert all(p.is_meta for p in model.parameters()), "a parameter was allocated before to_empty"
    model.to_empty(device=runtime.device)
    model.init_weights()
    return model


def _built_whole(job, runtime):
    """The debug model built whole on one device (no meta, no parallelism)."""
    from shardwise.tensor import random as sw_random
    from shardwise.train.models.llama import Transformer

    sw_random.manual_seed(job.seed)
    return Transformer(job.model_args())


def _train_with(build, argv: list[str]) -> list[float]:
    """The trainer's own loop with ``build`` as its model builder (restored afterwards)."""
    from shardwise.train import trainer

    saved = trainer.build_model
    trainer.build_model = build
    try:
        job = cli.job_from_argv(argv)
        return trainer.train(job, trainer.Runtime.create(job)).losses
    finally:
        trainer.build_model = saved


@pytest.mark.e2e
def test_debug_config_initialized_on_meta_gives_the_one_process_losses(dist):
    want = _train_with(_built_whole, DEBUG)
    per_rank = dist.run(4, _train_with, _built_on_meta, DEBUG + ["--nproc", "4", "--dp-shard", "2", "--tp", "2"],
                        timeout=240)
    assert len(want) == 5 and all(r == per_rank[0] for r in per_rank)
    worst = max(abs(g - w) / abs(w) for g, w in zip(per_rank[0], want))
    assert worst < 1e-5, f"meta-initialized FSDP+TP losses {per_rank[0]} differ from one process {want}"
