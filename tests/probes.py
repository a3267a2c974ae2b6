"""Independent measurements of what autograd keeps for backward, for tests."""

from functools import partial

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def _storage_ids(module: torch.nn.Module) -> set[int]:
    return {t.untyped_storage()._cdata for t in [*module.parameters(), *module.buffers()]}


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of distinct storages autograd saves for backward, parameters and buffers left out."""

    def __init__(self, module: torch.nn.Module):
        skip = _storage_ids(module)
        self.storages: dict[int, int] = {}

        def pack(t):
            s = t.untyped_storage()
            if s._cdata not in skip:
                self.storages[s._cdata] = s.nbytes()
            return t

        super().__init__(pack, lambda t: t)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


class LiveBytes(TorchDispatchMode):
    """Bytes of storages created inside the mode that are still alive when asked, parameters left out.

    Saved-tensor hooks do not see what a checkpoint keeps (its inputs, or the outputs selective
    checkpointing caches): those live in the checkpoint's own structures. Anything kept for backward, by
    whichever mechanism, keeps its storage alive, which this counts.
    """

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.skip = _storage_ids(module)
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.refs[s._cdata] = (StorageWeakRef(s), s.nbytes())
        return out

    @property
    def total(self) -> int:
        return sum(n for key, (ref, n) in self.refs.items() if not ref.expired() and key not in self.skip)


class PeakBytes(LiveBytes):
    """LiveBytes, and the most of it alive after any operator (`peak`)."""

    def __init__(self, module: torch.nn.Module | None = None):
        super().__init__(module if module is not None else torch.nn.Module())
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.peak = max(self.peak, self.total)
        return out


SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default, torch.ops.aten._grouped_mm.default}
"""The engine's selective policy (shardwise.activation_checkpoint), written out again: the matmuls, the attention
kernels and the experts' grouped GEMMs, which the planner assumes the engine keeps."""


def measure_saved(model, run, mode: str, exclude=(), alternate: bool = False) -> int:
    """Bytes held for backward after `run()`: every saved tensor (deduplicated by storage) that is not a parameter,
    a buffer or in `exclude`; with selective checkpointing, also the outputs the policy keeps. `alternate`: the
    selective policy is torchtitan's op-level one, which recomputes every second mm of a block instead of saving it
    (torchtitan/distributed/activation_checkpoint.py: "Saves output of all compute ops, except every second mm")."""
    constant = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), *exclude]}
    kept: dict[int, int] = {}

    def note(t: torch.Tensor) -> None:
        if hasattr(t, "wait"):  # the expert exchange's functional collectives return tensors to wait on
            t = t.wait()
        storage = t.untyped_storage()
        if storage.data_ptr() not in constant:
            kept[storage.data_ptr()] = storage.nbytes()

    def make_policy():
        mm_calls = [0]

        def policy(ctx, op, *args, **kwargs):
            if alternate and op == torch.ops.aten.mm.default:
                mm_calls[0] += 1
                if mm_calls[0] % 2 == 0:
                    return CheckpointPolicy.PREFER_RECOMPUTE
            if op in SAVED_OPS:
                outs = ctx.op_output if isinstance(ctx.op_output, (tuple, list)) else [ctx.op_output]
                for t in outs:
                    if isinstance(t, torch.Tensor):
                        note(t)
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return policy

    def contexts():
        return create_selective_checkpoint_contexts(make_policy())

    for layer in model.layers.values():
        if mode == "full":
            layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)
        elif mode == "selective":
            layer.forward = partial(checkpoint, layer.forward, use_reentrant=False, context_fn=contexts)

    def pack(t):
        note(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(kept.values())


def block_op_calls(block: torch.nn.Module, args, seq: int = 32, precision: str = "fp32") -> int:
    """Operators one forward and backward of a TransformerBlock dispatches under the precision's autocast (after a
    warm-up), less those of the input's own backward: what the planner's operator count says a block costs."""
    from shardwise.loss import autocast_context
    from shardwise.model import rotary_table
    from shardwise.planner.opcount import OpCounter

    leaf = torch.randn(2, seq, args.dim, requires_grad=True)
    rope = rotary_table(args, seq)

    def run(block):
        x = leaf.clone()  # an activation, as inside the model: autocast caches its casts of leaves (weights) only
        with autocast_context(precision, torch.device("cpu")):
            y = block(x, rope) if block is not None else x
        y.sum().backward()

    run(block)  # warm-up
    with OpCounter() as with_block:
        run(block)
    with OpCounter() as without:
        run(None)
    return with_block.calls - without.calls


class MatmulFlops(TorchDispatchMode):
    """2 x (rows x contracted x columns) of every mm, addmm and grouped GEMM dispatched, forward and backward,
    the out= and in-place forms included (the fused head writes its input gradient with mm(out=) and accumulates
    its weight gradient with addmm_, which torch's FlopCounterMode does not count)."""

    MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten._grouped_mm.default}
    ACCUMULATING = {torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default}

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.MATMULS or func in self.ACCUMULATING:
            a = args[0] if func in self.MATMULS else args[1]  # (rows, contracted); rows split into groups
            self.flops += 2 * a.shape[0] * a.shape[1] * out.shape[-1]
        return out


def engine_loss(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The micro-batch's summed loss as the trainer computes it (shardwise.train.loss_sum), the head fused with
    the loss where the engine fuses it (a single-device model: shardwise.model.fuse_head_loss)."""
    from shardwise.data import Batch
    from shardwise.model import fuse_head_loss
    from shardwise.train import loss_sum

    fuse_head_loss(model)
    return loss_sum(model, Batch(tokens, targets, []), tokens.device, "fp32")
