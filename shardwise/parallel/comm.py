"""Communication accounting: bytes each collective moves, per rank and step, by type.

`CommCounter` is a dispatch mode that sees every collective the step issues, whoever issues it (FSDP's
all-gathers and reduce-scatters, DTensor's redistributions, pipelining's sends, our own all-gathers), also
inside backward. For each it records the payload (the logical buffer: the tensor all-reduced, the gathered
output, the scattered input, the tensor sent) and the bytes one rank puts on the wire with ring algorithms:
all-reduce 2X(N-1)/N, all-gather and reduce-scatter Y(N-1)/N, all-to-all X(N-1)/N (exactly: X less the rows a
rank keeps, when the split sizes are uneven, as expert parallelism's are), point-to-point X.

It costs a Python call per op while active, so the trainer turns it on only for the steps it logs (the
collectives of a step do not change from step to step).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.distributed import ProcessGroup
from torch.utils._python_dispatch import TorchDispatchMode

TYPES = ("all_reduce", "all_gather", "reduce_scatter", "point_to_point", "all_to_all", "broadcast")

# c10d op name -> (type, index of the tensor(s) holding the payload, index of the process group)
_C10D = {
    "allreduce_": ("all_reduce", 0, 1),
    "allreduce_coalesced_": ("all_reduce", 0, 1),
    "_allgather_base_": ("all_gather", 0, 2),
    "allgather_": ("all_gather", 0, 2),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, 2),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 2),
    "reduce_scatter_": ("reduce_scatter", 1, 2),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 2),
    "alltoall_base_": ("all_to_all", 1, 2),
    "alltoall_": ("all_to_all", 1, 2),
    "broadcast_": ("broadcast", 0, 1),
    "send": ("point_to_point", 0, 1),
}
# functional collectives (DTensor): name -> (type, payload multiplier from group size?)
_FUNCTIONAL = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def wire_bytes(kind: str, payload: int, group_size: int) -> float:
    """Bytes one rank sends with ring algorithms, for a payload on a group of group_size ranks."""
    n = group_size
    if kind == "all_reduce":
        return 2 * payload * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return payload * (n - 1) / n
    return float(payload)  # point-to-point and broadcast (the sender's view)


def _group_size_from_name(name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name).size()


def _resolve_rank(name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name).rank()


@dataclass
class CommStats:
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    payload: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    wire: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, kind: str, payload: int, group_size: int, wire: float | None = None) -> None:
        if group_size <= 1:
            return  # a group of one moves nothing
        self.calls[kind] += 1
        self.payload[kind] += payload
        self.wire[kind] += wire_bytes(kind, payload, group_size) if wire is None else wire

    def as_metrics(self) -> dict[str, float]:
        """Flat metrics: comm/<type>_bytes (wire bytes per rank) and comm/<type>_calls, types with traffic."""
        out = {}
        for kind in TYPES:
            if self.calls.get(kind):
                out[f"comm/{kind}_bytes"] = self.wire[kind]
                out[f"comm/{kind}_calls"] = self.calls[kind]
        return out


class CommCounter(TorchDispatchMode):
    """Count the collectives run while active (this thread and the autograd threads it starts)."""

    def __init__(self):
        super().__init__()
        self.stats = CommStats()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, name = func.namespace, func._schema.name.split("::")[-1]
        if namespace == "c10d" and name in _C10D:
            kind, payload_at, group_at = _C10D[name]
            group = args[group_at]
            if isinstance(group, torch.ScriptObject):  # the dispatcher passes the group boxed
                group = ProcessGroup.unbox(group)
            payload = _nbytes(args[payload_at])
            wire = _all_to_all_wire(args[1], args[4], group.rank()) if name == "alltoall_base_" else None
            self.stats.add(kind, payload, group.size(), wire)
        elif namespace in ("_c10d_functional", "_c10d_functional_autograd") and name in _FUNCTIONAL:
            kind = _FUNCTIONAL[name]
            group = _group_size_from_name(args[-1])
            payload = _nbytes(args[0])
            if kind == "all_gather":
                payload *= group  # the input is one rank's piece; the payload is the gathered whole
            wire = None
            if name == "all_to_all_single":
                wire = _all_to_all_wire(args[0], args[2], _resolve_rank(args[-1]))
            self.stats.add(kind, payload, group, wire)
        return func(*args, **kwargs)


def _all_to_all_wire(x: torch.Tensor, splits: list[int], rank: int) -> float | None:
    """The bytes an all-to-all with these input split sizes sends to other ranks (None: even splits)."""
    if not splits:
        return None
    row = x[0].numel() * x.element_size() if x.shape[0] else 0
    return float((sum(splits) - splits[rank]) * row)


@contextlib.contextmanager
def uncounted():
    """Run with the active CommCounter off the dispatch stack, for code that issues no collective: torchao's
    low-bit optimizers compile their update with fullgraph=True, which refuses to run under a Python dispatch mode.
    (torch has no public way to step out of a mode.)"""
    from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

    if isinstance(_get_current_dispatch_mode(), CommCounter):
        with _pop_mode_temporarily():
            yield
    else:
        yield
