"""Replaceable gloo groups for op_coverage: a desync must cost a group, never a hang.

A ``Slot`` is one library's 1-D mesh on a process group of its own. When ranks fall out of step
on it (one raised while the others wait in a collective), ``Slot.destroy`` shuts the group's
sockets so the waiting peers fail at once, and the caller makes a new Slot. ``clear_caches``
lets the old groups be freed: a gloo group that stays referenced keeps its connections and a
polling thread.
"""

from __future__ import annotations

import datetime
import os


class Slot:
    """A library's 1-D mesh on a gloo group of its own, which can be torn down and replaced."""

    def __init__(self, lib: str, name: str, world: int, timeout: float) -> None:
        """A fresh group over all ``world`` ranks and a 1-D mesh named ``name`` on it.

        Every rank must create slots in the same order (``new_group`` is collective). Give each
        slot a new name: a cached sharding decision keyed on an older mesh then never matches.
        """
        import torch.distributed as dist

        before = _socket_fds()
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        after = _socket_fds()
        # This group's listener and peer connections, as (fd, inode): gloo closes a pair's fd when
        # the peer goes away and the number may then be reused, so the inode is checked again.
        self.sockets = sorted((fd, ino) for fd, ino in after.items() if before.get(fd) != ino)
        if lib == "shardwise":
            import shardwise as sw

            self.mesh = sw.DeviceMesh("cpu", list(range(world)), mesh_dim_names=(name,))
            self.mesh._groups = [self.group]  # run this mesh's collectives on the dedicated group
        else:
            from torch.distributed.device_mesh import DeviceMesh

            self.mesh = DeviceMesh.from_group(self.group, "cpu", mesh_dim_names=(name,))
        self.alive = True

    def seq(self) -> int:
        return int(self.group._get_sequence_number_for_group()) if self.alive else -1

    def destroy(self) -> None:
        """Tear the group down so that peers blocked in one of its collectives fail at once.

        Destroying a gloo group does not close its connections while anything still refers to
        it (the library's caches do), so its peer sockets are shut down directly: a peer waiting
        on this rank gets "Connection closed by peer", raises and shuts down its own in turn.
        """
        import socket

        import torch.distributed as dist

        if not self.alive:
            return
        self.alive = False
        try:
            dist.destroy_process_group(self.group)
        except Exception:  # noqa: BLE001 - already broken; it only has to go away
            pass
        for fd, ino in self.sockets:
            try:
                if os.fstat(fd).st_ino != ino:
                    continue  # closed by gloo, and the number reused by another socket
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):  # never the listener
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                sock.close()  # the duplicate only; the group closes its own when freed


def clear_caches() -> None:
    """Drop the libraries' cached decisions that are keyed on meshes (hence hold old groups)."""
    import gc

    from shardwise.dispatch.dispatcher import clear_cache

    clear_cache()
    try:  # private torch caches; missing ones (another torch version) only mean a small leak
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._collective_utils import MeshTopoInfo
        from torch.distributed.tensor._redistribute import _gen_transform_infos, clear_redistribute_planner_cache
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()
        _gen_transform_infos.cache_clear()
        clear_redistribute_planner_cache()
        MeshTopoInfo.build_from_mesh.cache_clear()
        type(DTensor._op_dispatcher.sharding_propagator)._propagate_tensor_meta_cached.cache_clear()
    except Exception:  # noqa: BLE001
        pass
    gc.collect()


def is_comm_failure(msg: str) -> bool:
    """An error a rank gets when a peer left a collective (it destroyed the group, or timed out)."""
    low = msg.lower()
    return any(w in low for w in ("connection closed", "timed out", "timeout", "connection reset", "broken pipe"))


def _socket_fds() -> dict[int, int]:
    """This process's open socket file descriptors and their inodes."""
    import stat

    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.fstat(int(name))
        except (OSError, ValueError):
            continue
        if stat.S_ISSOCK(st.st_mode):
            out[int(name)] = st.st_ino
    return out


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1
