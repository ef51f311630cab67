"""The dispatcher's per-context flags and its propagation cache (pure: no processes)."""

import contextvars
import threading

import torch

import shardwise as sw
from shardwise.dispatch import cache, flags, registry
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
        if old is None:
            registry._REGISTRY.pop(op, None)
        else:
            registry._REGISTRY[op] = old
        registry._invalidate_caches()
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
