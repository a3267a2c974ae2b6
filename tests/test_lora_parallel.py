"""LoRA under the parallel layouts: adapter placements under tensor parallelism, and parity with one device."""

import json
import subprocess
import sys
from pathlib import Path

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


CONFIG = str(Path(__file__).parent / "configs" / "parity.toml")
LORA_LAYOUTS = ["dp_replicate=2,zero_stage=1", "dp_shard=2", "tp=2,sequence_parallel=true", "pp=2",
                "dp_shard=2,tp=2"]


def _adapter_names(overrides: list[str]) -> set[str]:
    """The adapters the config gives the model: the parameters a LoRA run may change."""
    from shardwise.config import load_config
    from shardwise.lora import apply_lora, is_adapter
    from shardwise.model import build_model

    cfg = load_config(CONFIG, overrides)
    model = build_model(cfg.model)  # on the meta device: names only
    apply_lora(model, cfg.lora)
    return {name for name, _ in model.named_parameters() if is_adapter(name)}


@pytest.mark.multiprocess
def test_lora_layouts_match_single_device():
    """LoRA under ZeRO-1, ZeRO-3, TP + SP, PP and FSDP x TP trains like the single-device LoRA run (losses, gradient
    norms and every parameter at 1e-5, one `shardwise verify`); every adapter moved (B starts at zero, so A's
    gradient is zero until B has moved: 3 steps of momentum SGD see both), and every base weight is bitwise as
    initialised."""
    overrides = ["lora.rank=4", "lora.alpha=8"]
    args = ["verify", "--config", CONFIG, "--steps", "3", "--json", *[f"--set={o}" for o in overrides]]
    proc = subprocess.run([sys.executable, "-m", "shardwise", *args, *[f"--layout={t}" for t in LORA_LAYOUTS]],
                          capture_output=True, text=True, timeout=1200)
    assert proc.stdout, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    adapters = _adapter_names(overrides)
    assert [row["layout"] for row in report["layouts"]] == LORA_LAYOUTS
    for row in report["layouts"]:
        assert max(row["loss_rel"], row["grad_norm_rel"], row["param_rel"]) <= 1e-5, row
        assert set(row["trained"]) == adapters, row["layout"]
    assert proc.returncode == 0


def test_verify_refuses_lora_dropout_before_any_process(capsys, monkeypatch):
    """Dropout masks differ between one device and any layout: one line naming the field, nothing started."""
    import shardwise.verify
    from shardwise.cli import main

    def no_run(*args, **kwargs):
        raise AssertionError("a run was started")

    monkeypatch.setattr(shardwise.verify, "_train_here", no_run)
    monkeypatch.setattr(shardwise.verify, "_train_launched", no_run)
    code = main(["verify", "--config", CONFIG, "--set=lora.rank=4", "--set=lora.dropout=0.1", "--layout", "dp=2"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("shardwise: error: lora.dropout"), lines


def test_verify_explains_a_parameter_only_failure_under_an_adaptive_optimizer():
    """`verify --layout tp=2` of a LoRA config with AdamW printed FAIL (params 3.2e-5, loss and gradient norm exact)
    and nothing else; under momentum SGD the same layout is exact (1.0e-6)."""
    from shardwise.verify import adaptive_optimizer_note

    row = {"layout": "tp=2", "ok": False, "loss_rel": 0.0, "grad_norm_rel": 9.3e-8, "param_rel": 3.2e-5}
    note = adaptive_optimizer_note([row], "adamw", 1e-5)
    assert note.startswith("note: tp=2 matched the loss") and "--set optim.name=momentum" in note
    assert adaptive_optimizer_note([row], "momentum", 1e-5) is None  # a real difference: no excuse offered
    assert adaptive_optimizer_note([{**row, "grad_norm_rel": 1e-3}], "adamw", 1e-5) is None
    assert adaptive_optimizer_note([{**row, "ok": True}], "adamw", 1e-5) is None
