"""The parallel engine: one `parallelize()` that applies each parallelism in a fixed order.

Order (as torchtitan): tensor + sequence parallel -> expert parallel -> context parallel -> activation
checkpointing -> compile -> data parallel (ZeRO-0..3 / HSDP). Tensor and expert parallelism come first because they
change what the parameters are (DTensors); data parallelism comes last because it groups and shards whatever parameters
the model then has. Pipeline parallelism happens before all of this: the model is cut into stages and
each stage is parallelised on its own (see pipeline.py).
"""

from __future__ import annotations

import sys

from torch import nn

from shardwise.activation_checkpoint import apply_activation_checkpointing
from shardwise.config import JobConfig
from shardwise.distributed import before_shutdown
from shardwise.model import fuse_head_loss
from shardwise.parallel.data_parallel import apply_data_parallel
from shardwise.parallel.mesh import MeshView
from shardwise.parallel.tensor_parallel import apply_tensor_parallel


@before_shutdown
def _forget_dtensor_caches() -> None:
    """DTensor's sharding caches hold every mesh they saw, and so its process groups: empty them before a job's
    groups are destroyed (distributed.shutdown). Every DTensor shardwise makes comes through this package."""
    if "torch.distributed.tensor" in sys.modules:  # else no DTensor was made: nothing cached
        from shardwise.parallel.torch_private import forget_sharding_caches  # the simulator's heavy imports

        forget_sharding_caches()


def compile_block(block: nn.Module) -> None:
    """torch.compile a transformer block in place. A mixture-of-experts block is compiled part by part, as
    torchtitan compiles its MoE blocks: the attention, the norms, the router and the shared experts, while the
    routed experts run eagerly. Their shapes are the router's counts, known on the host only after a device sync
    (`.tolist()`), and torch 2.13's fake-tensor rule for the grouped GEMM takes bf16 only, where the eager CPU
    kernel also runs fp32: traced whole, the block fails in its first forward."""
    moe = getattr(block, "moe", None)
    if moe is None:
        block.compile()
        return
    for part in (block.attention_norm, block.attention, block.ffn_norm, moe.router, moe.shared):
        if part is not None:
            part.compile()


def parallelize(model: nn.Module, mesh: MeshView | None, cfg: JobConfig) -> None:
    """Apply every configured transform to `model` (one pipeline stage, or the whole model) in place."""
    p, t = cfg.parallel, cfg.train
    if mesh is not None:
        apply_tensor_parallel(model, mesh.tp, p.sequence_parallel)
        if p.ep > 1:
            from shardwise.parallel.expert_parallel import apply_expert_parallel

            apply_expert_parallel(model, mesh.ep)
        if p.cp > 1:
            from shardwise.parallel.context_parallel import apply_context_parallel

            apply_context_parallel(model, mesh.cp)
    apply_activation_checkpointing(model, p.activation_checkpoint, p.activation_checkpoint_every)
    if t.compile:
        for block in model.layers.values():
            compile_block(block)
    fuse_head_loss(model)  # a pipeline's last stage runs it in the schedule's loss (pipeline_loss)
    if mesh is not None:
        apply_data_parallel(model, mesh, p)
