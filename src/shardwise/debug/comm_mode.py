"""CommDebugMode: count the collectives shardwise issues, per module, with the bytes this rank sends."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from shardwise import comm
from shardwise.debug.comm_table import render_table
from shardwise.debug.counts import CommCounts
from shardwise.debug.module_tracker import GLOBAL, ModuleInfo, ModuleTracker, Phase, current_phase
from shardwise.core.mesh import DeviceMesh

__all__ = ["CommDebugMode", "CommRecord"]


@dataclass(frozen=True, slots=True)
class CommRecord:
    """One collective: its kind, the mesh axis it ran on, the bytes this rank sent, the modules
    active when it ran (outermost first), forward or backward."""

    kind: str
    mesh: DeviceMesh
    axis: int
    bytes_sent: int
    modules: tuple[str, ...] = ()
    phase: Phase = Phase.FORWARD

    @property
    def module(self) -> str:
        """The innermost active module ("Global" outside any module)."""
        return self.modules[-1] if self.modules else GLOBAL

    @property
    def axis_name(self) -> str:
        return self.mesh.axis_name(self.axis)

    def __str__(self) -> str:
        where = f" in {self.module}" + (" (backward)" if self.phase is Phase.BACKWARD else "")
        return f"{self.kind} on {self.axis_name} ({self.bytes_sent} B){where}"


class CommDebugMode:
    """Context manager recording every collective issued inside it, on this rank.

    Counts answer to shardwise's names and to torch's collective objects
    (``torch.ops.c10d_functional.all_gather_into_tensor``, ``funcol.all_reduce`` ...), so code
    written against ``torch.distributed.tensor.debug.CommDebugMode`` reads them unchanged.
    Inside, modules are tracked (forward and backward, see ``module_tracker``): each collective
    is filed under the modules that were running.

    Example:
        >>> with CommDebugMode() as comms:
        ...     dt.redistribute(mesh, [Replicate()])
        >>> comms.get_comm_counts()
        {'all_gather': 1}
        >>> comms.get_comm_counts()[torch.ops.c10d_functional.all_gather_into_tensor]
        1
        >>> comms.bytes_sent
        96
        >>> print(comms.generate_comm_debug_tracing_table(noise_level=1))
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []
        self._tracker: ModuleTracker | None = None

    def record(self, kind: str, mesh: DeviceMesh, axis: int, bytes_sent: int) -> None:
        """Called by ``comm`` for each collective (the ``CommRecorder`` protocol)."""
        tracker = self._tracker
        modules = tracker.active() if tracker is not None else ()
        self.records.append(CommRecord(kind, mesh, axis, bytes_sent, modules, current_phase()))

    def __enter__(self) -> "CommDebugMode":
        self.records.clear()
        self._tracker = ModuleTracker()
        self._tracker.start()
        comm.add_recorder(self)
        return self

    def __exit__(self, *exc) -> None:
        comm.remove_recorder(self)
        if self._tracker is not None:
            self._tracker.stop()

    # ------------------------------------------------------------------ counts
    def get_comm_counts(self) -> CommCounts:
        """Number of collectives of each kind, e.g. ``{'all_gather': 1}``.

        Look-ups also accept torch's collective ops and functions (see ``CommCounts``).
        """
        return _counts(self.records)

    def get_total_counts(self) -> int:
        """Number of collectives issued."""
        return len(self.records)

    @property
    def bytes_sent(self) -> int:
        """Total bytes this rank sent."""
        return sum(r.bytes_sent for r in self.records)

    def get_per_module_comm_counts(self) -> dict[str, CommCounts]:
        """``{module path: counts}`` for "Global" and every module entered, forward and backward
        together; a module counts the collectives of its submodules too (as torch's table).

        Example:
            >>> comms.get_per_module_comm_counts()["Sequential.2"]
            {'all_reduce': 1}
        """
        return {name: _counts(self._records_in(name)) for name in self._module_names()}

    @property
    def comm_module_counts(self) -> dict[str, dict[str, CommCounts]]:
        """``{module path: {"forward": counts, "backward": counts}}``, torch's attribute."""
        return {
            name: {phase.value: _counts(r for r in self._records_in(name) if r.phase is phase) for phase in Phase}
            for name in self._module_names()
        }

    def get_sharding_info(self) -> dict[str, tuple]:
        """Placements of the DTensor parameters of the modules entered, by parameter path."""
        return {f"{info.fqn}.{name}": spec.placements
                for info in self.modules().values() for name, spec in info.parameters.items()}

    def modules(self) -> dict[str, ModuleInfo]:
        """The modules entered inside the mode, in order of first entry."""
        return dict(self._tracker.modules) if self._tracker is not None else {}

    def _module_names(self) -> list[str]:
        return [GLOBAL, *self.modules()]

    def _records_in(self, name: str):
        return [r for r in self.records if name == GLOBAL or name in r.modules]

    # ------------------------------------------------------------------ rendering
    def summary(self) -> str:
        """One line per collective, in issue order."""
        return "\n".join(map(str, self.records)) or "no collectives"

    def generate_comm_debug_tracing_table(self, noise_level: int = 3) -> str:
        """The module tree with each module's collectives, forward and backward.

        Args:
            noise_level: 0: per module and phase, count and bytes of each collective on each
                mesh axis; 1: also each module's type and the layouts of its DTensor
                parameters; 2 and 3: also every collective, under the module that issued it.
        Returns:
            The table as text (print it).
        """
        return render_table(self.records, self.modules(), noise_level)

    def log_comm_debug_tracing_table_to_file(self, file_name: str = "comm_mode_log.txt", noise_level: int = 3) -> None:
        """Write ``generate_comm_debug_tracing_table(noise_level)`` to ``file_name``."""
        with open(file_name, "w") as f:
            f.write(self.generate_comm_debug_tracing_table(noise_level) + "\n")

    def __str__(self) -> str:
        return self.generate_comm_debug_tracing_table(noise_level=0)


def _counts(records: Any) -> CommCounts:
    return CommCounts(Counter(r.kind for r in records))
