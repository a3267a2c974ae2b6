"""LoRA under the parallel layouts: adapter placements under tensor parallelism, and parity with one device."""

import pytest


def _split_adapted_linears() -> list[dict]:
    """One LoRALinear (B != 0) split column-wise and one row-wise over the 2 ranks, against the same module on
    one device: outputs, full gradients, placements, and the collectives of the forward."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import parallelize_module

    from shardwise.lora import LoRALinear
    from shardwise.parallel.comm import CommCounter
    from shardwise.parallel.tensor_parallel import ColwiseLoRA, RowwiseLoRA

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = []
    for style in (ColwiseLoRA(output_layouts=Replicate()), RowwiseLoRA(input_layouts=Replicate())):
        torch.manual_seed(0)
        reference = LoRALinear(16, 12, rank=4, alpha=8.0, dropout=0.0)
        for p in reference.parameters():
            torch.nn.init.normal_(p)
        reference.weight.requires_grad_(False)
        split = LoRALinear(16, 12, rank=4, alpha=8.0, dropout=0.0)
        split.load_state_dict(reference.state_dict())
        split.weight.requires_grad_(False)
        parallelize_module(split, mesh, style)
        x, direction = torch.randn(3, 16), torch.randn(3, 12)
        (reference(x) * direction).sum().backward()
        with CommCounter() as counter:
            out = split(x)
        (out * direction).sum().backward()
        results.append({
            "out": (out.detach(), reference(x).detach()),
            "grads": {n: (getattr(split, n).grad.full_tensor(), getattr(reference, n).grad)
                      for n in ("lora_a", "lora_b")},
            "placements": {n: p.placements for n, p in split.named_parameters()},
            "frozen": (split.weight.requires_grad, split.weight.grad),
            "forward_comm": dict(counter.stats.calls),
        })
    return results


@pytest.mark.multiprocess
def test_adapters_are_placed_after_their_base_and_compute_the_one_device_result():
    """Column-wise base: A replicated, B split by rows like W; row-wise base: A split by columns like W, B
    replicated. Outputs and adapter gradients equal one device's; the row-wise forward reduces its partial sums
    once (the adapter's partial sum joins the base's), the column-wise one only gathers its output."""
    import torch
    from torch.distributed.tensor import Replicate, Shard

    from distributed import run_distributed

    for colwise, rowwise in run_distributed(_split_adapted_linears, 2):
        assert colwise["placements"] == {"weight": (Shard(0),), "lora_a": (Replicate(),), "lora_b": (Shard(0),)}
        assert rowwise["placements"] == {"weight": (Shard(1),), "lora_a": (Shard(1),), "lora_b": (Replicate(),)}
        assert colwise["forward_comm"] == {"all_gather": 1}
        assert rowwise["forward_comm"] == {"all_reduce": 1}
        for case in (colwise, rowwise):
            torch.testing.assert_close(*case["out"], rtol=1e-5, atol=1e-5)
            for got, want in case["grads"].values():
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert case["frozen"] == (False, None)
