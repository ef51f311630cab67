"""The in-place contract: an op that writes into a DTensor either keeps that tensor's placements
exactly (and its own local block, so views of it see the write) with the single-device value,
or raises the kind of error torch.distributed.tensor raises for the same call; ``copy_`` never
changes the placement of the tensor it writes.

torch's DTensor runs the same cases in the same worker, as the oracle for which calls may fail
and how.
"""

import torch

import shardwise as sw
from shardwise.debug import CommDebugMode

_LOCAL = torch.tensor([[-1.0, 0.5, 2.0, -3.0], [1.5, -0.5, 0.25, 4.0], [0.0, 3.0, -2.5, 1.0], [2.0, -1.5, 0.5, -0.25]])


def _contribution(k: int) -> torch.Tensor:
    return _LOCAL * (k + 1) - k


# name -> (self layout, source layout or None, op on (self, source), single-device op on values)
_CASES = {
    "clamp_ P(sum)": ("P", None, lambda s, o: s.clamp_(min=0), lambda s, o: s.clamp(min=0)),
    "relu_ P(sum)": ("P", None, lambda s, o: s.relu_(), lambda s, o: s.relu()),
    "neg_ P(max)": ("Pmax", None, lambda s, o: s.neg_(), lambda s, o: -s),
    "cumsum_ S(0) along 0": ("S0", None, lambda s, o: s.cumsum_(0), lambda s, o: s.cumsum(0)),
    "fill_ P(sum)": ("P", None, lambda s, o: s.fill_(2.0), lambda s, o: torch.full_like(s, 2.0)),
    "mul_ P*P": ("P", "P", lambda s, o: s.mul_(o), lambda s, o: s * o),
    "add_ P+R": ("P", "R", lambda s, o: s.add_(o), lambda s, o: s + o),
    "copy_ P<-R": ("P", "R", lambda s, o: s.copy_(o), lambda s, o: o),
    "copy_ P<-S": ("P", "S0", lambda s, o: s.copy_(o), lambda s, o: o),
    "copy_ S<-P": ("S0", "P", lambda s, o: s.copy_(o), lambda s, o: o),
    "copy_ R<-S": ("R", "S0", lambda s, o: s.copy_(o), lambda s, o: o),
    "copy_ P(max)<-R": ("Pmax", "R", lambda s, o: s.copy_(o), lambda s, o: o),
    "copy_ P<-P broadcast row": ("P", "Prow", lambda s, o: s.copy_(o), lambda s, o: o.expand_as(s)),
    "copy_ P<-P(max)": ("P", "Pmax", lambda s, o: s.copy_(o), lambda s, o: o),
}


def _layouts(api):
    Partial, Replicate, Shard = api.Partial, api.Replicate, api.Shard
    return {"P": [Partial()], "Pmax": [Partial("max")], "R": [Replicate()], "S0": [Shard(0)],
            "Prow": [Partial()]}


def _make(api, mesh, layout: str, salt: int):
    """A DTensor of ``api`` in ``layout`` and its single-device value (built without collectives)."""
    rank, n = mesh.get_local_rank(0), mesh.size(0)
    parts = [_contribution(k + salt) for k in range(n)]
    if layout == "Prow":
        parts = [p[:1] for p in parts]
    if layout in ("P", "Prow"):
        value, local = sum(parts), parts[rank]
    elif layout == "Pmax":
        value, local = torch.stack(parts).amax(0), parts[rank]
    else:
        value = parts[0]
        local = value.chunk(n, 0)[rank] if layout == "S0" else value
    placements = _layouts(api)[layout]
    return api.DTensor.from_local(local.clone(), mesh, placements, shape=value.shape, stride=value.stride()), value


def _run(api, mesh, case):
    self_layout, src_layout, op, _ = case
    x, _ = _make(api, mesh, self_layout, 0)
    src = _make(api, mesh, src_layout, 3)[0] if src_layout else None
    before, block = tuple(x.placements), x._local_tensor
    try:
        returned = op(x, src)
    except Exception as err:  # noqa: BLE001 - the kind of error is the result
        return ("error", type(err), str(err).splitlines()[0])
    return ("ok", tuple(x.placements) == before, x._local_tensor is block, returned is x, x)


def _body():
    import torch.distributed.tensor as torch_api
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    ours_mesh = sw.init_device_mesh("cpu", (4,))
    theirs_mesh = torch_mesh("cpu", (4,))
    out = {}
    for name, case in _CASES.items():
        expected_self = _make(sw, ours_mesh, case[0], 0)[1]
        expected_src = _make(sw, ours_mesh, case[1], 3)[1] if case[1] else None
        expected = case[3](expected_self.clone(), expected_src)
        with CommDebugMode() as comms:
            ours = _run(sw, ours_mesh, case)
        if ours[0] == "ok":
            ours = ours[:-1] + (ours[-1].full_tensor(),)  # outside the counted region
        theirs = _run(torch_api, theirs_mesh, case)
        out[name] = (ours, theirs[:2] if theirs[0] == "error" else ("ok",), expected, comms.get_total_counts())
    return out


def test_in_place_ops_keep_self_layout_or_fail_like_torch(dist):
    for result in dist.run(4, _body):
        for name, (ours, theirs, expected, comms) in result.items():
            if ours[0] == "error":
                # Failing is allowed only where torch fails too, with the same kind of error.
                assert theirs[0] == "error" and issubclass(ours[1], theirs[1]), f"{name}: {ours} vs torch {theirs}"
                continue
            _, kept, same_block, returned_self, value = ours
            assert kept and same_block and returned_self, f"{name}: placements or block changed"
            assert torch.allclose(value, expected, atol=1e-6), f"{name}: {value} != {expected}"
        for name in result:
            if name.startswith("copy_"):
                assert result[name][0][0] == "ok", f"{name}: {result[name][0]}"
        # Written on coordinate 0 only, as the pending sum needs: no collective.
        assert result["fill_ P(sum)"][3] == 0 and result["add_ P+R"][3] == 0 and result["copy_ P<-R"][3] == 0


def _out_into_partial():
    mesh = sw.init_device_mesh("cpu", (4,))
    x = sw.distribute_tensor(torch.ones(2, 4), mesh, [sw.Replicate()], src_data_rank=None)
    out = sw.DTensor.from_local(torch.zeros(2, 4), mesh, [sw.Partial()])
    torch.exp(x, out=out)


def test_out_argument_that_cannot_keep_its_layout_raises_on_every_rank(dist):
    dist.run_expect_error(4, _out_into_partial, match=r"aten\.exp\.out.*in-place.*layout", exc_type=RuntimeError)
