"""``aten._foreach_*`` ops, foreach optimizers and gradient-norm clipping on DTensors.

Parameters use mixed placements on one mesh (Shard(0), Shard(1), Replicate, nested, uneven
shapes); every result is compared with the same computation on plain tensors.
"""

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.debug import CommDebugMode

# Global shapes (uneven over 2 and 4 ranks) and their layouts on a (2, 2) mesh / a (4,) mesh.
SHAPES = [(5, 7), (7, 3), (6,), (3, 5)]
LAYOUTS_2D = [[Shard(0), Shard(1)], [Shard(1), Replicate()], [Replicate(), Replicate()], [Replicate(), Shard(0)]]
LAYOUTS_1D = [[Shard(0)], [Shard(1)], [Replicate()], [Shard(0)]]
# A layout different from the parameter's, for gradients that arrive differently laid out.
OTHER_2D = [[Shard(1), Shard(0)], [Replicate(), Replicate()], [Shard(0), Replicate()], [Shard(0), Shard(1)]]


def _mesh(shape):
    return sw.init_device_mesh("cpu", shape)


def _full(values):
    return [v.full_tensor() if isinstance(v, DTensor) else v for v in values]


def _close(got, want, atol=1e-5) -> bool:
    got = _full(got)
    return len(got) == len(want) and all(
        g.shape == w.shape and torch.allclose(g, w, atol=atol, rtol=1e-4, equal_nan=True) for g, w in zip(got, want)
    )


def _foreach_cases():
    """Out-of-place and in-place foreach ops against plain torch, one result per case."""
    mesh = _mesh((2, 2))
    torch.manual_seed(0)
    xs = [torch.randn(s) for s in SHAPES]
    ys = [torch.randn(s) for s in SHAPES]
    dx = [sw.distribute_tensor(x, mesh, l) for x, l in zip(xs, LAYOUTS_2D)]
    dy = [sw.distribute_tensor(y, mesh, l) for y, l in zip(ys, OTHER_2D)]
    scalars = [0.5, -1.0, 2.0, 0.25]
    cases = {
        "add_list_alpha": lambda a, b: torch._foreach_add(a, b, alpha=2.0),
        "add_scalar": lambda a, b: torch._foreach_add(a, 1.5),
        "sub_scalarlist": lambda a, b: torch._foreach_sub(a, scalars),
        "mul_list": lambda a, b: torch._foreach_mul(a, b),
        "mul_tensor": lambda a, b: torch._foreach_mul(a, torch.tensor(0.3)),
        "div_list": lambda a, b: torch._foreach_div(a, torch._foreach_add(torch._foreach_abs(b), 1.0)),
        "neg": lambda a, b: torch._foreach_neg(a),
        "sqrt_abs": lambda a, b: torch._foreach_sqrt(torch._foreach_abs(a)),
        "addcmul_value": lambda a, b: torch._foreach_addcmul(a, b, b, value=0.1),
        "addcdiv_scalarlist": lambda a, b: torch._foreach_addcdiv(a, b, torch._foreach_add(torch._foreach_abs(a), 1.0), scalars),
        "lerp_scalar": lambda a, b: torch._foreach_lerp(a, b, 0.3),
        "lerp_list": lambda a, b: torch._foreach_lerp(a, b, torch._foreach_abs(torch._foreach_sign(b))),
        "maximum_list": lambda a, b: torch._foreach_maximum(a, b),
        "minimum_scalar": lambda a, b: torch._foreach_minimum(a, 0.1),
        "clamp_min_scalar": lambda a, b: torch._foreach_clamp_min(a, -0.2),
        "pow_scalar_and_tensor": lambda a, b: torch._foreach_pow(2.0, a),
        "pow_scalar": lambda a, b: torch._foreach_pow(a, 2),
        "reciprocal": lambda a, b: torch._foreach_reciprocal(torch._foreach_add(torch._foreach_abs(a), 1.0)),
        "exp_sigmoid": lambda a, b: torch._foreach_sigmoid(torch._foreach_exp(a)),
        "norm_2": lambda a, b: torch._foreach_norm(a),
        "norm_1": lambda a, b: torch._foreach_norm(a, 1),
        "norm_3": lambda a, b: torch._foreach_norm(a, 3),
        "norm_inf": lambda a, b: torch._foreach_norm(a, float("inf")),
        "norm_0": lambda a, b: torch._foreach_norm(torch._foreach_clamp_min(a, 0.0), 0),
        "max": lambda a, b: torch._foreach_max(a),
        "powsum_3_float64": lambda a, b: torch.ops.aten._foreach_powsum(a, 3, dtype=torch.float64),
        "div_by_plain_scalars": lambda a, b: torch._foreach_div(a, [torch.tensor(2.0 + i) for i in range(len(a))]),
        "clone": lambda a, b: torch._foreach_clone(a),
        "copy": lambda a, b: torch.ops.aten._foreach_copy(a, b),
        "zero": lambda a, b: torch.ops.aten._foreach_zero(a),
    }
    results = {name: _close(fn(dx, dy), fn(xs, ys)) for name, fn in cases.items()}
    results["norm_keeps_no_gather"] = _norm_comms(dx)
    outs, douts = [torch.zeros(s) for s in SHAPES], [d.clone() for d in dx]
    torch.ops.aten._foreach_mul.List_out(dx, dy, out=douts)
    torch.ops.aten._foreach_mul.List_out(xs, ys, out=outs)
    results["out_variant"] = _close(douts, outs) and [d.placements for d in douts] == [d.placements for d in dx]

    # In place: the mutated DTensors keep their identity and layout.
    a, da = [x.clone() for x in xs], [d.clone() for d in dx]
    ids, layouts = [id(d) for d in da], [d.placements for d in da]
    steps = [
        lambda t, u: torch._foreach_add_(t, u, alpha=0.5),
        lambda t, u: torch._foreach_mul_(t, 0.9),
        lambda t, u: torch._foreach_mul_(t, torch.tensor(1.1)),
        lambda t, u: torch._foreach_addcmul_(t, u, u, value=0.01),
        lambda t, u: torch._foreach_maximum_(t, u),
        lambda t, u: torch._foreach_lerp_(t, u, 0.2),
        lambda t, u: torch._foreach_div_(t, scalars),
        lambda t, u: torch._foreach_clamp_max_(t, 0.7),
        lambda t, u: torch._foreach_sqrt_(torch._foreach_clamp_min_(t, 0.0)),
        lambda t, u: torch._foreach_copy_(t, u),
        lambda t, u: torch._foreach_zero_(t),
    ]
    for i, step in enumerate(steps):
        step(da, dy)
        step(a, ys)
        results[f"in_place_step_{i}"] = _close(da, a)
    results["in_place_keeps_identity_and_layout"] = [id(d) for d in da] == ids and [d.placements for d in da] == layouts
    return results


def _norm_comms(dx) -> bool:
    """Norms of sharded tensors: local partial norms plus small all_reduces, never a gather."""
    with CommDebugMode() as comms:
        norms = torch._foreach_norm(dx)
    counts = comms.get_comm_counts()
    return "all_gather" not in counts and all(n.placements == (Replicate(), Replicate()) for n in norms)


def test_foreach_ops_match_plain_torch(dist):
    for rank, results in enumerate(dist.run(4, _foreach_cases)):
        assert all(results.values()), f"rank {rank}: wrong: {[k for k, ok in results.items() if not ok]}"


def _grads(step: int, shapes):
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=generator) for s in shapes]


def _optimizers(mesh_shape):
    """SGD / Adam / AdamW (foreach) on DTensor parameters vs plain parameters, 3 steps each."""
    mesh = _mesh(mesh_shape)
    layouts = LAYOUTS_2D if len(mesh_shape) == 2 else LAYOUTS_1D
    grad_layouts = list(layouts)
    if len(mesh_shape) == 2:
        grad_layouts[1] = OTHER_2D[1]  # one gradient laid out unlike its parameter
    configs = {
        "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=True),
        "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True, foreach=True),
        "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1, foreach=True),
        "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True, foreach=True),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.05, foreach=True),
    }
    results = {}
    for name, make in configs.items():
        torch.manual_seed(1)
        inits = [torch.randn(s) for s in SHAPES]
        ref = [torch.nn.Parameter(t.clone()) for t in inits]
        params = [torch.nn.Parameter(sw.distribute_tensor(t.clone(), mesh, l)) for t, l in zip(inits, layouts)]
        ref_opt, opt = make(ref), make(params)
        for step in range(3):
            grads = _grads(step, SHAPES)
            for p, r, g, gl in zip(params, ref, grads, grad_layouts):
                r.grad = g.clone()
                p.grad = sw.distribute_tensor(g.clone(), mesh, gl)
            ref_opt.step()
            opt.step()
            results[f"{name} step {step}"] = _close(params, [r.detach() for r in ref])
        results[f"{name} keeps layouts"] = [tuple(p.placements) for p in params] == [tuple(l) for l in layouts]
    return results


def test_foreach_optimizers_match_single_device(dist):
    for shape in [(2, 2), (4,)]:
        for rank, results in enumerate(dist.run(4, _optimizers, shape)):
            assert all(results.values()), f"mesh {shape} rank {rank}: wrong: {[k for k, ok in results.items() if not ok]}"


def _clip(mesh_shape):
    """clip_grad_norm_ over parameters with mixed placements: total norm and clipped grads."""
    mesh = _mesh(mesh_shape)
    layouts = LAYOUTS_2D if len(mesh_shape) == 2 else LAYOUTS_1D
    results = {}
    for norm_type in (2.0, 1.0, 3.0, float("inf")):
        for foreach in (True, False):
            for max_norm in (0.5, 1e4):  # clipping, and a no-op clip (coefficient clamped to 1)
                torch.manual_seed(2)
                grads = [torch.randn(s) * (i + 1) for i, s in enumerate(SHAPES)]
                ref = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
                params = [torch.nn.Parameter(sw.distribute_tensor(torch.zeros(s), mesh, l)) for s, l in zip(SHAPES, layouts)]
                for p, r, g, l in zip(params, ref, grads, layouts):
                    r.grad = g.clone()
                    p.grad = sw.distribute_tensor(g.clone(), mesh, l)
                want = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type=norm_type, foreach=foreach)
                with CommDebugMode() as comms:
                    got = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type, foreach=foreach)
                key = f"p={norm_type} foreach={foreach} max_norm={max_norm}"
                # Per-gradient norms are local partial norms plus small all_reduces: no gathers.
                results[f"{key} no gather ({comms.get_comm_counts()})"] = "all_gather" not in comms.get_comm_counts()
                results[f"{key} total norm"] = _close([got], [want])
                results[f"{key} clipped grads"] = _close([p.grad for p in params], [r.grad for r in ref])
                results[f"{key} grad layouts kept"] = [tuple(p.grad.placements) for p in params] == [tuple(l) for l in layouts]
    return results


def test_clip_grad_norm_with_mixed_placements(dist):
    for shape in [(2, 2), (4,)]:
        for rank, results in enumerate(dist.run(4, _clip, shape)):
            assert all(results.values()), f"mesh {shape} rank {rank}: wrong: {[k for k, ok in results.items() if not ok]}"


def _partial_grads():
    """Gradients still pending a sum (Partial) are reduced before clipping and stepping."""
    mesh = _mesh((4,))
    rank = dist.get_rank()
    torch.manual_seed(3)
    contributions = torch.randn(4, 5, 3)
    ref = torch.nn.Parameter(torch.zeros(5, 3))
    ref.grad = contributions.sum(0)
    param = torch.nn.Parameter(sw.distribute_tensor(torch.zeros(5, 3), mesh, [Shard(0)]))
    param.grad = DTensor.from_local(contributions[rank].clone(), mesh, [Partial()])
    want = torch.nn.utils.clip_grad_norm_([ref], 1.0, foreach=True)
    got = torch.nn.utils.clip_grad_norm_([param], 1.0, foreach=True)
    torch.optim.SGD([ref], lr=0.1, foreach=True).step()
    torch.optim.SGD([param], lr=0.1, foreach=True).step()
    return _close([got], [want]) and _close([param], [ref.detach()])


def test_partial_gradients_are_reduced_before_use(dist):
    assert all(dist.run(4, _partial_grads))
