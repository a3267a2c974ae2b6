"""Independent measurements of what autograd keeps for backward, for tests."""

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


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
