"""The private torch APIs the simulator relies on, in one place so a torch upgrade touches one file.

None has a public equivalent in torch 2.13:
- the "fake" process-group backend is registered by importing `torch.testing._internal.distributed.fake_pg`;
- `FakeTensorMode` and `unset_fake_temporarily` (torch._subclasses): tensors with shapes, dtypes and devices
  but no storage;
- the memory trackers of `torch.distributed._tools` (`MemTracker`, `FSDPMemTracker`), subclassed to note the
  moment of the peak and to keep only the global peak per op (their private `_track`, `_update_peak_stats`,
  `_curr_mem_snap`, `_mod_tracker`, `_in_opt`, `_in_ac`; `memory_tracking`, `_pre_fw_hook`,
  `_fsdp_state_pre_forward`, `_root_mod` and `_update_and_maybe_create_winfos`, to track a pipeline's stages,
  each run once per micro-batch, and its receive buffers); their `ModTracker`'s `_fw_pre_hook` (leaf inputs
  under autograd.grad, see `_ModTracker`) and the `register_multi_grad_hook` its module calls (swapped for one
  whose hooks go once fired, see `_ModTracker`); `ReplicateModule`, to tell ZeRO-0/1 apart;
- DTensor's `ShardingPropagator._propagate_tensor_meta_non_cached`, wrapped so the tracker skips its
  global-shape tensors (`untracked_sharding_propagation`);
- DTensor's sharding caches, cleared between simulated ranks and before a job's process groups are destroyed
  (`forget_sharding_caches`);
- `DeviceMesh.__init__`, wrapped so that a mesh made while fake mode is on (FSDP makes a TP x FSDP mesh inside
  `fully_shard`) keeps a real rank table;
- the pipeline schedules' `_PipelineSchedule._warmup_p2p` (the first step's vote on whether stages infer their
  shapes) and `InferenceMode`, to give the vote's outcome on a fake process group (`unanimous_pipeline_vote`);
  their stage set-up (`_initialize_stage(s)`) and their stages' receive buffers (`args_recv_info`,
  `grad_recv_info`), to start the simulated step where the real run's later steps start
  (`initialize_pipeline`, `pipeline_buffers`).
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
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule
from torch.distributed._tools import mod_tracker
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._pytree import tree_map_only

__all__ = ["FakeTensors", "PeakMoment", "build_tracker", "fake_scalar", "forget_sharding_caches",
           "init_fake_process_group", "initialize_pipeline", "pipeline_buffers", "unanimous_pipeline_vote",
           "untracked_sharding_propagation"]


def init_fake_process_group(rank: int, world_size: int) -> None:
    """A default process group of `world_size` ranks that this one process joins as `rank`: every collective
    returns at once without moving data (the outputs keep whatever they held), so no other rank need exist."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))


def forget_sharding_caches() -> None:
    """DTensor caches sharding decisions keyed by meshes, and meshes compare equal by shape alone, not by their
    process groups: a second simulated rank (a new process group) would reuse the first one's groups. The caches
    also keep every mesh they saw, and its process groups, alive (see distributed.shutdown)."""
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import _gen_transform_infos, clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()
    clear_redistribute_planner_cache()


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

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        """torch's trackers hook every parameter's gradient, which raises on a frozen one (LoRA's base weights):
        count every parameter, hook only those that get gradients (as torch's own hooks do)."""
        memory = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            for param in module.parameters():
                if param.requires_grad and param not in self._param_to_grad_hook_handles:
                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(self._track_grad),
                        param.register_post_accumulate_grad_hook(lambda p: self._track_grad(p.grad)))
        return memory

    def _track_grad(self, grad: torch.Tensor) -> None:
        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

    def _current_moment(self) -> PeakMoment:
        if self._in_opt:
            return PeakMoment("optimizer", [])
        parents = sorted(p for p in self._mod_tracker.parents if p != "Global")
        innermost = [p for p in parents if not any(q.startswith(p + ".") for q in parents)]
        phase = "recompute" if self._in_ac else "backward" if self._mod_tracker.is_bw else "forward"
        return PeakMoment(phase, innermost)


class _ModTracker(ModTracker):
    """torch's module tracker, for a pipeline's stages.

    It watches a module's inputs with a multi-grad hook to see its backward end, which raises under
    autograd.grad when an input is a leaf: a pipeline stage's received activation under zero-bubble (its input
    gradients are an autograd.grad). Such an input is shown to it as a detached alias (same storage, same
    bytes): that module's backward then counts as ending with the step's backward.

    Its hooks must also not keep the graph alive. A multi-grad hook in "all" mode holds the grad_fn of every
    tensor it watches and sits on those grad_fns: a cycle through C++ that Python's collector cannot see, so
    the nodes live as long as the hook. After an ordinary backward that costs nothing (each node released its
    saved tensors when it ran), but zero-bubble's input pass retains the graph and its weight pass never runs
    the input-only nodes (attention, norms): their saved tensors stayed until the step ended, and the
    simulator reported zero-bubble's middle ranks up to 1.75x what the engine holds. Each hook is therefore
    removed once it has fired, at the end of that backward call (autograd's queue_callback: removing a hook
    while the engine iterates a node's hooks is not safe)."""

    def _fw_pre_hook(self, mod, input):
        return super()._fw_pre_hook(mod, tree_map_only(
            torch.Tensor, lambda a: a.detach() if a.requires_grad and a.is_leaf else a, input))

    def __enter__(self):
        mod_tracker.register_multi_grad_hook = _removed_once_fired
        return super().__enter__()

    def __exit__(self, *args):
        mod_tracker.register_multi_grad_hook = register_multi_grad_hook
        return super().__exit__(*args)


def _removed_once_fired(tensors, fn, *, mode: str = "all"):
    """register_multi_grad_hook whose hooks are removed at the end of the backward call in which `fn` ran."""
    handle = None

    def once(*args):
        fn(*args)
        torch.autograd.Variable._execution_engine.queue_callback(handle.remove)

    handle = register_multi_grad_hook(tensors, once, mode=mode)
    return handle


class _StagesMixin:
    """A pipeline stage is a root module called once per micro-batch, which the trackers take for the next
    iteration and refuse. Their per-module statistics are not read here: the stage's start afresh at each of
    its forwards (its parameters' gradient hooks are installed once and stay)."""

    def _init_stages(self, stages: list[nn.Module]) -> None:
        self.stages = stages
        if stages:
            self._mod_tracker = _ModTracker()

    def _forget_stage(self, module: nn.Module) -> None:
        if not self._mod_tracker.is_bw and any(module is m for m in self.stages):
            self.memory_tracking.pop(module, None)


class _Tracker(_StagesMixin, _MomentMixin, MemTracker):
    def __init__(self, stages: list[nn.Module], roots: list[nn.Module]):
        super().__init__()
        self._init_moment()
        self._init_stages(stages)
        self._roots, self._root_hooks = roots, []

    def _pre_fw_hook(self, module: nn.Module, inputs) -> None:
        self._forget_stage(module)
        super()._pre_fw_hook(module, inputs)

    def __enter__(self):
        # The tracker's own pre-forward hook is global, so it runs before replicate's, which makes the working
        # copies of the weights: each module's copies are counted as parameters when that module's forward
        # starts. A root's weight that no module's forward uses (the fused head's: shardwise.loss.head_loss_sum)
        # would first be seen as an operator's output, an activation; this hook, the root's own and registered
        # after replicate's, counts the root's working copies as parameters once they exist.
        self._root_hooks = [root.register_forward_pre_hook(self._track_root) for root in self._roots]
        return super().__enter__()

    def __exit__(self, *args):
        for hook in self._root_hooks:
            hook.remove()
        return super().__exit__(*args)

    def _track_root(self, module: nn.Module, inputs) -> None:
        self._track_module_params_and_buffers(module, install_grad_hooks=False)


class _FSDPTracker(_StagesMixin, _MomentMixin, FSDPMemTracker):
    def __init__(self, roots: list[nn.Module], optim: torch.optim.Optimizer | None, stages: list[nn.Module]):
        super().__init__(roots[0], optim)
        # several FSDP roots (a rank's pipeline stages): the tracker only walks its root's modules and buffers
        self._root_mod = roots[0] if len(roots) == 1 else nn.ModuleList(roots)
        self._init_moment()
        self._init_stages(stages)

    def _fsdp_state_pre_forward(self, fsdp_mod, orig_fsdp_state_pre_fw):
        inner = super()._fsdp_state_pre_forward(fsdp_mod, orig_fsdp_state_pre_fw)

        def pre_forward(*args, **kwargs):
            self._forget_stage(fsdp_mod)
            return inner(*args, **kwargs)

        return pre_forward


def build_tracker(modules: list[nn.Module], optimizer: torch.optim.Optimizer, schedule=None) -> MemTracker:
    """The memory tracker for one step: FSDP's (all-gather / reduce-scatter buffers as their own categories)
    when the model is FSDP roots (ZeRO-2/3: one module, or a pipeline `schedule`'s stages), the generic one
    otherwise (FSDP's raises on ZeRO-0/1's `replicate`, whose bucketed groups of blocks it reads as a module
    called twice). Enter it only once the model and optimizer exist: what exists then is counted from the
    start, and so are a pipeline's receive buffers (received activations and gradients, kept between steps),
    as "Inputs" (FSDP's) or "Other" (the generic tracker's). The roots are called once per micro-batch, as a
    pipeline's stages are (see _StagesMixin), under gradient accumulation too."""
    stages = modules
    buffers = [] if schedule is None else pipeline_buffers(schedule)
    if all(isinstance(m, FSDPModule) and not isinstance(m, ReplicateModule) for m in modules):
        tracker = _FSDPTracker(modules, optimizer, stages)
        for t in buffers:
            tracker._update_and_maybe_create_winfos(t, _FSDPRefType.INP)
        return tracker
    tracker = _Tracker(stages, modules)
    tracker.track_external(*modules, optimizer, *buffers)
    return tracker


def _pipeline_stages(schedule) -> list:
    return list(schedule._stages) if hasattr(schedule, "_stages") else [schedule._stage]


def pipeline_buffers(schedule) -> list[torch.Tensor]:
    """The receive buffers of a pipeline schedule's stages (activations from the previous stage, gradients from
    the next, one per micro-batch), made at its first step and kept: memory no module or optimizer owns."""
    infos = [info for stage in _pipeline_stages(schedule)
             for table in (stage.args_recv_info, stage.grad_recv_info) for chunk in table.values() for info in chunk]
    return [info.buffer for info in infos if getattr(info, "buffer", None) is not None]


def initialize_pipeline(schedule) -> None:
    """What a schedule's first step does before its first micro-batch: the stages' send/receive plans and
    receive buffers, from the shapes the stages were given (and the vote, see `unanimous_pipeline_vote`). The
    simulator runs it before the measured step, so that step is the steady state the real run's later steps
    are. The arguments the schedule would pass (the first micro-batch, its target) serve only to infer shapes."""
    for stage in _pipeline_stages(schedule):
        stage.has_backward = schedule._has_backward
    if hasattr(schedule, "_stages"):
        schedule._initialize_stages((), {}, None)
    else:
        schedule._initialize_stage((), {}, None)


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


@contextlib.contextmanager
def unanimous_pipeline_vote():
    """A pipeline schedule's first step opens with a vote passed stage to stage (send/recv of one int32): did
    every stage get its shapes up front? If so no stage infers them (a dummy forward and backward and metadata
    sent between the pipeline ranks). On a fake process group the received vote is whatever its buffer held.
    `build_pipeline` gives every stage its shapes, so every stage of the real job votes yes: set that outcome
    instead of voting (each stage checked as the vote checks it). The real first step also sends the vote's
    few bytes; later steps send nothing of it."""
    from torch.distributed.pipelining._utils import InferenceMode
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    def decided(schedule, stages, has_backward, p2p_done):
        for stage in stages:
            if InferenceMode.needs_dynamic(stage._user_meta, has_backward):
                raise RuntimeError(f"pipeline stage {stage.stage_index} was built without its input/output shapes")
            stage._inference_mode = InferenceMode.STATIC

    original = _PipelineSchedule._warmup_p2p
    _PipelineSchedule._warmup_p2p = decided
    try:
        yield
    finally:
        _PipelineSchedule._warmup_p2p = original
