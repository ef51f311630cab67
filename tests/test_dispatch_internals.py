"""The dispatcher's per-context flags, its propagation cache and its argument walker (pure: no
processes, except one distributed body running ops with nested tensor lists)."""

import collections
import contextvars
import threading

import torch
from torch.utils import _pytree as pytree

import shardwise as sw
from shardwise.dispatch import cache, flags, registry, walk
from shardwise.dispatch.dispatcher import ImplicitScope


def _in_thread(fn):
    """``fn()``'s result, run on a fresh thread."""
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def _flag_state():
    return flags.implicit(), flags.fallback_enabled()


def test_implicit_replication_and_fallback_hold_for_the_current_context_only():
    """A ``with`` in one thread does not change the flags another thread dispatches with
    (autograd, a data loader or a checkpoint writer may run ops there meanwhile)."""
    assert _flag_state() == (False, False)
    with sw.implicit_replication(), sw.allow_replicate_fallback():
        inside = _flag_state()
        other_thread = _in_thread(_flag_state)
        copied = contextvars.copy_context().run(_flag_state)  # a task started from here inherits
    assert inside == (True, True)
    assert other_thread == (False, False)
    assert copied == (True, True)
    assert _flag_state() == (False, False)

    # A thread's own setting is invisible here, even while it is inside its ``with``.
    entered, release, seen = threading.Event(), threading.Event(), []

    def hold():
        with sw.implicit_replication(ImplicitScope(integer_tensors=True)):
            seen.append(flags.implicit())
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    entered.wait(10)
    here = _flag_state()
    release.set()
    thread.join()
    assert seen == [ImplicitScope(integer_tensors=True)] and here == (False, False)


def test_nested_and_reused_context_managers_restore_the_outer_setting():
    scope = ImplicitScope(integer_tensors=True)
    manager = sw.implicit_replication(scope)
    with manager:
        with sw.implicit_replication():
            with manager:  # the same object entered twice: a full setting is not narrowed
                assert flags.implicit() is True
            assert flags.implicit() is True
        assert flags.implicit() == scope
    assert flags.implicit() is False


def test_the_process_wide_fallback_default_reaches_every_thread_and_invalidates():
    version = cache.registry_version()
    try:
        sw.allow_replicate_fallback.set(True)
        assert cache.registry_version() == version + 1
        assert _in_thread(flags.fallback_enabled) is True
    finally:
        sw.allow_replicate_fallback.set(False)
    assert flags.fallback_enabled() is False


def _restore_registration(op, old) -> None:
    """Put ``op``'s registration back as it was before a test registered its own."""
    if old is None:
        registry._REGISTRY.pop(op, None)
    else:
        registry._REGISTRY[op] = old
    registry._invalidate_caches()


def test_registering_an_op_invalidates_the_propagation_cache():
    plans = cache.PLANS
    plans.put(("test", "entry"), "decided", cache.registry_version())
    assert plans.get(("test", "entry")) == "decided"
    before = cache.registry_version()

    op = torch.ops.aten.special_entr.default
    old = registry.lookup(op)
    try:
        @registry.register_sharding(op)
        def _(schema):
            return [([sw.Replicate()], [sw.Replicate()])]

        assert cache.registry_version() == before + 1
        assert plans.get(("test", "entry")) is None  # emptied
        # A decision computed while the registry changed (another thread registering during a
        # propagation) is not stored: it may rest on the old registration.
        plans.put(("test", "stale"), "decided", before)
        assert plans.get(("test", "stale")) is None
        # memo (the custom handlers' cache) is the same cache.
        made = []
        assert plans.memo(("test", "memo"), lambda: made.append(1) or "choice") == "choice"
        assert plans.memo(("test", "memo"), lambda: made.append(1) or "again") == "choice" and made == [1]
    finally:
        _restore_registration(op, old)
    assert plans.get(("test", "memo")) is None


def test_the_cache_is_bounded_and_safe_under_concurrent_inserts():
    small = cache.PropagationCache(64)
    version = cache.registry_version()

    def insert(base):
        for k in range(500):
            small.put((base, k), k, version)
            small.get((base, k - 1))

    threads = [threading.Thread(target=insert, args=(b,)) for b in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(small) == 64


def test_the_flag_context_managers_do_not_break_a_compiled_graph():
    """Dynamo cannot trace context variables: entering the flags inside a compiled function
    must neither break the graph nor leave a flag set."""

    def f(x):
        with sw.implicit_replication(), sw.allow_replicate_fallback():
            y = x * 2
        return y + 1

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0))
    assert _flag_state() == (False, False)


# ---------------------------------------------------------------------- the argument walker
class _Marked(torch.Tensor):
    """Stands for DTensor here: the walker takes the type it looks for as an argument."""


def _marked(n: int) -> torch.Tensor:
    t = torch.zeros(n).as_subclass(_Marked)
    t._spec = ("spec", n)
    return t


_Pair = collections.namedtuple("_Pair", "first second")


def test_the_walker_follows_pytree_on_nested_lists_tuples_and_dicts():
    """Order, paths, swaps and keys agree with torch's pytree at any depth (foreach-style lists
    of lists, ``[None, index]`` lists, tensors inside keyword lists and dicts), containers keep
    their types and the caller's are never changed."""
    a, b, c, d, e = (_marked(n) for n in (1, 2, 3, 4, 5))
    plain = torch.ones(2)
    args = (a, [b, None, (c, 7)], [1, 2], _Pair(d, 0.5))
    kwargs = {"weights": [plain, {"deep": e}], "alpha": 2}
    reference = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, _Marked)]

    assert walk.dtensors(args, kwargs, _Marked) == reference == [a, b, c, d, e]
    found: list = []
    key = (walk.signature(args, found, _Marked), walk.signature(kwargs.values(), found, _Marked))
    assert found == reference  # the hot path's key finds them in the same order
    hash(key)
    other: list = []
    assert (walk.signature(args, other, _Marked), walk.signature(kwargs.values(), other, _Marked)) == key
    moved = (a, [b, None, (_marked(9), 7)], [1, 2], _Pair(d, 0.5))
    assert walk.signature(moved, [], _Marked) != key[0]  # a spec deep inside is part of the key

    where = walk.slots(args, kwargs, _Marked)
    assert where.positional is None
    assert [walk.at(args, kwargs, path) for path in where.paths] == reference
    assert dict(walk.labelled(args, kwargs))["weights[0]"] is plain
    assert "#2[1]" in dict(walk.labelled(args, kwargs))

    new_args, new_kwargs = walk.put(args, kwargs, where, ["A", "B", "C", "D", "E"])
    expect_args, expect_kwargs = pytree.tree_map(
        lambda x: {id(a): "A", id(b): "B", id(c): "C", id(d): "D", id(e): "E"}.get(id(x), x), (args, kwargs))
    assert tuple(new_args) == expect_args and new_kwargs == expect_kwargs
    assert type(new_args[1][2]) is tuple and type(new_args[3]) is _Pair and new_kwargs["weights"][0] is plain
    assert args[1][0] is b and kwargs["weights"][1]["deep"] is e  # the originals are untouched

    shallow_args, shallow_kwargs = (a, (None, b), 3), {"out": [c, d]}  # index's [None, idx], out= lists
    shallow = walk.slots(shallow_args, shallow_kwargs, _Marked)
    assert shallow.shallow is not None and where.shallow is None
    assert walk.put(shallow_args, shallow_kwargs, shallow, "ABCD") == (["A", (None, "B"), 3], {"out": ["C", "D"]})
    assert shallow_kwargs["out"] == [c, d]

    flat = walk.slots((a, 3, b), {}, _Marked)
    assert flat.positional == (0, 2)
    assert walk.put((a, 3, b), {}, flat, ["A", "B"]) == (["A", 3, "B"], {})

    spec_args, spec_kwargs = walk.spec_tree(args, kwargs, _Marked)
    hash((spec_args, spec_kwargs[1]))  # lists become tuples: a plan cache can key on them
    assert spec_args[1] == (("spec", 2), None, (("spec", 3), 7)) and spec_args[3].first == ("spec", 4)


def test_the_walker_wraps_nested_results_in_leaf_order_and_renders_calls():
    x, y, z = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    out = (x, [y, None, z], 5)
    specs = ("sx", "sy", None, "sz")  # one per leaf; None: left as it is
    wrapped = walk.wrap_results(out, specs, lambda t, s: (s, t.numel()))
    assert wrapped == (("sx", 1), [("sy", 2), None, ("sz", 3)], 5)
    assert [s for s in pytree.tree_leaves(wrapped) if isinstance(s, str)] == ["sx", "sy", "sz"]
    assert walk.wrap_results(x, ("only",), lambda t, s: s) == "only"
    assert walk.wrap_results(x, (None,), lambda t, s: s) is x
    assert walk.leaves(out) == pytree.tree_leaves(out)
    shown = walk.render([x, (1, {"k": [y]})], lambda v: f"t{v.numel()}" if isinstance(v, torch.Tensor) else repr(v))
    assert shown == "[t1, [1, {k: [t2]}]]"
    # Meshes, placements and specs are pytree constants (for torch.compile): still leaves here.
    assert walk.leaves([sw.Replicate(), (sw.Shard(0),)]) == [sw.Replicate(), sw.Shard(0)]


def _nested_calls():
    mesh = sw.init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    full = [torch.randn(4, 3, requires_grad=True) for _ in range(3)]
    a, b, c = (sw.distribute_tensor(t.detach(), mesh, [sw.Shard(0)]).requires_grad_() for t in full)
    ok = {}
    # A list of DTensors (cat), values and gradients.
    joined = torch.cat([a, b, c], dim=1)
    joined.sum().backward()
    want = torch.cat(full, dim=1)
    want.sum().backward()
    ok["cat"] = torch.equal(joined.full_tensor(), want)
    ok["cat_grads"] = all(torch.equal(d.grad.full_tensor(), t.grad) for d, t in zip((a, b, c), full))
    # A DTensor inside [None, index] (index.Tensor), and one in a keyword (out=).
    table = sw.distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [sw.Replicate()])
    idx = sw.distribute_tensor(torch.tensor([2, 0, 1, 2]), mesh, [sw.Shard(0)])
    ok["index"] = torch.equal(table[:, idx].full_tensor(), torch.arange(12.0).reshape(4, 3)[:, [2, 0, 1, 2]])
    # Lists of lists of DTensors (_foreach ops), out of place and in place.
    xs = [sw.distribute_tensor(t.detach(), mesh, [sw.Shard(0)]) for t in full]
    ys = [sw.distribute_tensor(t.detach() * 2, mesh, [sw.Replicate()]) for t in full]
    sums = torch._foreach_add(xs, ys)
    ok["foreach"] = all(torch.equal(s.full_tensor(), t.detach() * 3) for s, t in zip(sums, full))
    torch._foreach_mul_(xs, 2.0)
    ok["foreach_"] = all(torch.equal(x.full_tensor(), t.detach() * 2) for x, t in zip(xs, full))
    return ok


def test_ops_with_nested_tensor_lists_match_one_device(dist):
    for rank, ok in enumerate(dist.run(2, _nested_calls)):
        assert all(ok.values()), f"rank {rank}: {ok}"


def _specialized_calls():
    """A user's custom handler with ``specialize``: asked once per call signature; its runner
    serves every call of that signature, the handler the signatures it declines."""
    op = torch.ops.aten.special_entr.default
    old = registry.lookup(op)
    seen = collections.Counter()

    def specialize(func, args, kwargs):
        seen["specialize"] += 1
        if not args[0].placements[0].is_shard():
            return None
        spec = args[0]._spec

        def run(func, args, kwargs, dtensors):
            seen["runner"] += 1
            return sw.DTensor(func(args[0]._local_tensor), spec, requires_grad=False)

        return run

    @registry.register_custom_handler(op, specialize=specialize, replace=True)
    def handler(func, args, kwargs):
        seen["handler"] += 1
        return sw.DTensor(func(args[0]._local_tensor), args[0]._spec, requires_grad=False)

    try:
        mesh = sw.init_device_mesh("cpu", (2,))
        full = torch.rand(4, 3) + 0.1
        sharded = sw.distribute_tensor(full, mesh, [sw.Shard(0)])
        replicated = sw.distribute_tensor(full, mesh, [sw.Replicate()])
        outs = [torch.special.entr(sharded) for _ in range(3)] + [torch.special.entr(replicated) for _ in range(2)]
        equal = all(torch.allclose(o.full_tensor(), torch.special.entr(full)) for o in outs)
        return dict(seen), equal
    finally:
        _restore_registration(op, old)


def test_a_custom_handler_may_specialize_per_call_signature(dist):
    for seen, equal in dist.run(2, _specialized_calls):
        assert equal
        assert seen == {"specialize": 2, "runner": 3, "handler": 2}, seen
