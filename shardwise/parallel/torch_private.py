"""The private torch APIs the simulator relies on, in one place so a torch upgrade touches one file.

None has a public equivalent in torch 2.13:
- the "fake" process-group backend is registered by importing `torch.testing._internal.distributed.fake_pg`;
- `FakeTensorMode` and `unset_fake_temporarily` (torch._subclasses): tensors with shapes, dtypes and devices
  but no storage;
- the memory trackers of `torch.distributed._tools` (`MemTracker`, `FSDPMemTracker`), subclassed to note the
  moment of the peak and to keep only the global peak per op (their private `_track`, `_update_peak_stats`,
  `_curr_mem_snap`, `_mod_tracker`, `_in_opt`, `_in_ac`); `ReplicateModule`, to tell ZeRO-0/1 apart;
- DTensor's `ShardingPropagator._propagate_tensor_meta_non_cached`, wrapped so the tracker skips its
  global-shape tensors (`untracked_sharding_propagation`);
- DTensor's sharding caches, cleared between simulated ranks (`forget_sharding_caches`);
- `DeviceMesh.__init__`, wrapped so that a mesh made while fake mode is on (FSDP makes a TP x FSDP mesh inside
  `fully_shard`; a pipeline build parallelises its stages inside fake mode) keeps a real rank table.
The mesh helpers (DeviceMesh._flatten, FSDP2's replicate) stay in compat.py with the engine that uses them.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor._sharding_prop import ShardingPropagator

__all__ = ["FakeTensors", "PeakMoment", "build_tracker", "fake_scalar", "forget_sharding_caches",
           "init_fake_process_group", "untracked_sharding_propagation"]


def init_fake_process_group(rank: int, world_size: int) -> None:
    """A default process group of `world_size` ranks that this one process joins as `rank`: every collective
    returns at once without moving data (the outputs keep whatever they held), so no other rank need exist."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))


def forget_sharding_caches() -> None:
    """DTensor caches sharding decisions keyed by meshes, and meshes compare equal by shape alone, not by their
    process groups: a second simulated rank (a new process group) would reuse the first one's groups."""
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()


_TOTAL_KEY = "Total"
# the trackers' categories of model state (MemTracker's, then FSDPMemTracker's names)
_MODEL_STATE = ("Parameter", "Gradient", "Optstate", "Sharded Param", "Sharded Grad", "OptState")


def fake_scalar(func, args) -> float | int | None:
    """What `.item()` / `float()` of a fake tensor reads: 1 (the trainer logs the loss and clips by the gradient
    norm; fake tensors hold no number, and neither value changes what memory the step uses). None: not that op."""
    if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
        return 1.0 if args[0].is_floating_point() else 1
    return None


class FakeTensors:
    """Inside `with` (re-enterable; one FakeTensorMode throughout, since fake tensors of two modes don't mix),
    every tensor created is fake and real tensors met are faked too, except a DeviceMesh's rank table: the
    mesh computes its coordinates from it, which fake tensors cannot."""

    def __init__(self):
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._stack: list[contextlib.ExitStack] = []

    def __enter__(self) -> FakeTensors:
        original = DeviceMesh.__init__

        def init(mesh, *args, **kwargs):
            with unset_fake_temporarily():
                original(mesh, *args, **kwargs)

        stack = contextlib.ExitStack()
        DeviceMesh.__init__ = init
        stack.callback(setattr, DeviceMesh, "__init__", original)
        stack.enter_context(self.mode)
        self._stack.append(stack)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.pop().close()


@dataclass
class PeakMoment:
    """Where the step was when memory peaked."""

    phase: str
    """'forward', 'backward', 'recompute' (activation checkpointing in backward) or 'optimizer'."""
    modules: list[str]
    """The innermost modules running then (fully qualified names)."""


class _MomentMixin:
    """Keeps only what the simulator reads, per op: the peak total, its split and moment, and the largest bytes
    of each model-state category. (The trackers' own per-op update also keeps every module's peak, which
    costs a pass over all modules per op; we don't read those.)"""

    def _init_moment(self) -> None:
        self.moment = PeakMoment("start", [])
        self.paused = 0  # > 0 while DTensor propagates shardings (its tensors are shapes, not memory)
        self.category_max: dict[str, int] = {}
        self._watched = [k for k in self._ref_class if k.value in _MODEL_STATE]

    def _track(self, reftype, t: torch.Tensor) -> None:
        if not self.paused:
            super()._track(reftype, t)

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            total = snap[_TOTAL_KEY]
            if self._peak_mem.get(dev, 0) < total:
                self._peak_mem[dev] = total
                self._peak_mem_snap[dev] = dict(snap)
                self.moment = self._current_moment()
            for key in self._watched:
                if snap.get(key, 0) > self.category_max.get(key.value, 0):
                    self.category_max[key.value] = snap[key]

    def _current_moment(self) -> PeakMoment:
        if self._in_opt:
            return PeakMoment("optimizer", [])
        parents = sorted(p for p in self._mod_tracker.parents if p != "Global")
        innermost = [p for p in parents if not any(q.startswith(p + ".") for q in parents)]
        phase = "recompute" if self._in_ac else "backward" if self._mod_tracker.is_bw else "forward"
        return PeakMoment(phase, innermost)


class _Tracker(_MomentMixin, MemTracker):
    def __init__(self):
        super().__init__()
        self._init_moment()


class _FSDPTracker(_MomentMixin, FSDPMemTracker):
    def __init__(self, mod: nn.Module, optim: torch.optim.Optimizer | None):
        super().__init__(mod, optim)
        self._init_moment()


def build_tracker(modules: list[nn.Module], optimizer: torch.optim.Optimizer) -> MemTracker:
    """The memory tracker for one step: FSDP's (all-gather / reduce-scatter buffers as their own categories)
    when the model is one FSDP root (ZeRO-2/3), the generic one otherwise (FSDP's raises on ZeRO-0/1's
    `replicate`, whose bucketed groups of blocks it reads as a module called twice). Enter it only once
    the model and optimizer exist: what exists then is counted from the start."""
    if len(modules) == 1 and isinstance(modules[0], FSDPModule) and not isinstance(modules[0], ReplicateModule):
        return _FSDPTracker(modules[0], optimizer)
    tracker = _Tracker()
    tracker.track_external(*modules, optimizer)
    return tracker


@contextlib.contextmanager
def untracked_sharding_propagation(tracker: MemTracker):
    """DTensor works out an op's output shape by running it on global-shape fake tensors. Outside fake mode it
    makes its own FakeTensorMode and the tracker ignores it; inside ours it reuses ours, and the tracker would
    count those global-shape tensors as memory. Pause the tracker for the duration."""
    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self, op_schema):
        tracker.paused += 1
        try:
            return original(self, op_schema)
        finally:
            tracker.paused -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original
