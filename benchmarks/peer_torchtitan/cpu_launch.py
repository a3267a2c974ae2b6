"""Run torchtitan 0.3.0's trainer on CPU with gloo: `torchrun ... cpu_launch.py <torchtitan.train arguments>`.

torchtitan as shipped trains on an accelerator only. Each patch below bends one place where it assumes one,
or where 0.3.0 calls a torch API that torch 2.13.0 does not have; all are applied before `torchtitan.train`
is imported, so the trainer's modules import the patched names. Run with torchtitan's venv (it imports
torchtitan and torch only).
"""

import runpy
import sys
import types
from datetime import timedelta

import torch
import torch.distributed as dist


def use_cpu_as_device() -> None:
    # torchtitan picks `_get_available_device_type() or "cuda"` at import time and calls torch.cuda-style
    # helpers (set_device, synchronize, memory stats) on it. Point both at "cpu" and a module of no-ops.
    import torchtitan.tools.utils as titan_utils

    cpu = types.ModuleType("cpu_device")
    cpu.set_device = lambda device: None
    cpu.current_device = lambda: 0
    cpu.device_count = lambda: 1
    cpu.synchronize = lambda *args, **kwargs: None
    cpu.get_device_name = lambda *args, **kwargs: "cpu"
    cpu.empty_cache = lambda: None
    cpu.reset_peak_memory_stats = lambda *args, **kwargs: None
    cpu.memory_stats = lambda *args, **kwargs: {}
    # only read for the "memory: x GiB (y%)" column of the log; any size will do
    cpu.get_device_properties = lambda *args, **kwargs: types.SimpleNamespace(total_memory=24 * 2**30, name="cpu")
    cpu.is_available = lambda: True
    titan_utils.device_type = "cpu"
    titan_utils.device_module = cpu


def reduce_gradients_with_sum() -> None:
    # torchtitan sets FSDP2's gradient_divide_factor to 1.0 (it divides by the global token count itself);
    # FSDP2 then reduces with ReduceOp.PREMUL_SUM, which gloo does not have. Force plain SUM reductions: with
    # a factor of 1.0 they give the same gradients.
    import torchtitan.distributed.fsdp as titan_fsdp
    from torch.distributed.fsdp import FSDPModule

    disable_division = titan_fsdp.disable_fsdp_gradient_division

    def disable_division_with_sum(model: torch.nn.Module) -> None:
        disable_division(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    titan_fsdp.disable_fsdp_gradient_division = disable_division_with_sum


def add_set_timeout() -> None:
    # torchtitan 0.3.0 lowers the process groups' timeout after the first step with
    # torch.distributed.set_timeout, which torch 2.13.0 does not have; its private helper does the same.
    from torch.distributed import distributed_c10d

    if not hasattr(dist, "set_timeout"):
        def set_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
            distributed_c10d._set_pg_timeout(timeout, group)

        dist.set_timeout = set_timeout


def accept_split_microbatches() -> None:
    # torchtitan 0.3.0 calls schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...) with the batch already
    # cut into micro-batches; torch 2.13.0's schedules only take the whole batch and cut it themselves. Given
    # micro-batches, do what their step() does after the cut (reset the stages, run _step_microbatches).
    from torch.distributed.pipelining import schedules

    def wrap(cls: type) -> None:
        whole_batch_step = cls.step

        def step(self, *args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True,
                 loss_kwargs=None, **kwargs):
            if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
                return whole_batch_step(self, *args, losses=losses, return_outputs=return_outputs,
                                        loss_kwargs=loss_kwargs, **kwargs)
            for stage in getattr(self, "_stages", None) or [self._stage]:
                stage.has_backward = self._has_backward
                stage.clear_runtime_states()
            self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
            return None  # torchtitan passes return_outputs=False and reads the losses list

        cls.step = step

    wrap(schedules.PipelineScheduleSingle)
    wrap(schedules.PipelineScheduleMulti)


if __name__ == "__main__":
    use_cpu_as_device()  # first: the other patched modules import device_type from torchtitan.tools.utils
    reduce_gradients_with_sum()
    add_set_timeout()
    accept_split_microbatches()
    sys.argv = ["torchtitan.train"] + sys.argv[1:]
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
