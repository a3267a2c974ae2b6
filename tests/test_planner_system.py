"""The planner's system descriptions (shardwise.planner.system): what each changes, checked against the bytes a
model really saves, hand counts, and published measurements of the system that ran them."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from shardwise.activation_checkpoint import apply_activation_checkpointing
from shardwise.hardware import GiB
from shardwise.model import build_model, materialize
from shardwise.model_args import ModelArgs, num_params, preset
from shardwise.planner import Cluster, Plan, PlannerError, Training, accelerator, evaluate
from shardwise.planner.cli import add_plan_arguments, run_plan, system_of
from shardwise.planner.memory import (
    adapter_groups,
    block_backward_bytes,
    block_terms,
    dtensor_loss_parallel,
    embedding_activation_bytes,
    gathered_unit_bytes,
    gathered_weight_bytes,
    head_activation_bytes,
    layer_activation_bytes,
    linear_shapes,
    logits_bytes,
    lora_params,
    moment_memory,
    peak_moment,
    reserved_bytes,
    stage_memory,
    term_bytes,
    weight_copy_bytes,
)
from shardwise.planner.search import check_recipe
from shardwise.planner.system import SYSTEMS, System, resolve_system
from shardwise.planner.timing import layer_times, recomputed_matmul_share, stage_cost, te_float8_cast_seconds

from distributed import run_distributed
from probes import LiveBytes, MatmulFlops, PeakBytes, engine_loss, measure_saved


def _training(system: str, **kw) -> Training:
    return Training(**{"seq_len": 4096, "global_batch": 8, **kw, **SYSTEMS[system].training_fields()})


def _fsdp_units(args: ModelArgs) -> tuple[tuple[int, float], tuple[int, float]]:
    """(count, parameters) of FSDP's units on one rank without tp: the blocks, and the root (the rest)."""
    from shardwise.planner.memory import layer_params

    block = layer_params(args, 1)
    return (args.n_layers, block), (1, num_params(args) - args.n_layers * block)


def _bf16_reduction_saving(args: ModelArgs, plan: Plan, cluster: Cluster) -> float:
    """Seconds a bf16 reduction saves over an fp32 one in FSDP's reduce-scatters, unit by unit, by hand."""
    from shardwise.planner.comm import axis_link, reduce_scatter

    n, link = axis_link(plan, plan.shard_axes, cluster, spread=True)
    return sum(count * (reduce_scatter(4 * p, n, link) - reduce_scatter(2 * p, n, link))
               for count, p in _fsdp_units(args))


def test_shardwise_system_is_the_default_recipe():
    # every Training built without a system (tests, benchmarks, the simulator's checks) describes shardwise
    ours, default = _training("shardwise"), Training(seq_len=4096, global_batch=8)
    assert ours.fuses_head and default.fuses_head
    assert dataclasses.replace(ours, fuse_head=None) == default


def test_torchtitan_keeps_bf16_everywhere_and_gathers_bf16_weights():
    titan, ours = _training("torchtitan"), _training("shardwise")
    assert (titan.stream_bytes, titan.act_bytes, gathered_weight_bytes(titan)) == (2, 2, 2.0)
    assert (ours.stream_bytes, ours.act_bytes, gathered_weight_bytes(ours)) == (4, 2, 4.0)
    args = preset("llama3-8b")
    plan = Plan(dp_shard=8, zero_stage=3, micro_batch=1)
    assert weight_copy_bytes(args, titan, plan, 0) == 0.0  # FSDP2 hands the matmuls bf16 weights: no autocast copies
    assert weight_copy_bytes(args, ours, plan, 0) > 0.0


def test_torchtitan_selective_policy_keeps_every_second_matmul_by_hand():
    # kept per token: block input (d), wq (d), wv (kv), attention output (d) and its fp32 log-sum-exp (one per
    # head), w1 (f), w2 (d); in bf16
    args = preset("llama3-8b")
    d, kv, f, a = args.dim, args.n_kv_heads * args.head_dim, args.ffn_hidden, args.n_heads
    training = _training("torchtitan")
    plan = Plan(activation_checkpoint="selective")
    per_token = sum(term_bytes(t, args, training, plan) for t in block_terms(args, training, "selective", 3))
    assert per_token == 2 * (4 * d + kv + f) + 4 * a


def test_alternate_matmul_policy_matches_saved_tensors():
    # torchtitan's rule applied to our block with torch's selective checkpointing: what it really keeps
    args, b, s = preset("debug", dim=128, n_layers=3, n_heads=8, n_kv_heads=2, ffn_hidden=352, vocab_size=320), 2, 96
    model = build_model(args)
    materialize(model, args, "cpu", 0)
    tokens = torch.randint(0, args.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    measured = measure_saved(model, lambda: engine_loss(model, tokens, tokens + 0), "selective", alternate=True)
    training = Training(seq_len=s, global_batch=b, precision="fp32",
                        selective="alternate-matmuls")
    plan = Plan(micro_batch=b, activation_checkpoint="selective")
    predicted = (args.n_layers * layer_activation_bytes(args, training, plan)
                 + head_activation_bytes(args, training, plan) + embedding_activation_bytes(args, training, plan))
    assert predicted == pytest.approx(measured, rel=0.10)


def test_recomputed_matmul_share_by_hand():
    args = preset("llama3-8b")  # d 4096, kv 1024, f 14336
    d, kv, f = 4096, 1024, 14336
    assert recomputed_matmul_share(args, 1) == pytest.approx((d * kv + d * d + d * f) / (2 * d * d + 2 * d * kv
                                                                                         + 3 * d * f))


def _backward_matmul_flops(model, tokens) -> tuple[int, int]:
    """(forward, backward) linear FLOPs of one step of `model` on `tokens`."""
    with MatmulFlops() as fwd:
        logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    with MatmulFlops() as bwd:
        loss.backward()
    return fwd.flops, bwd.flops


def test_full_recompute_runs_all_but_the_last_linear_again_as_the_planner_prices_it():
    # torch's non-reentrant checkpoint (this engine's full recompute) stops at the block's last saved tensor: w2's
    # input. Measured on the engine's blocks: the extra backward matmul FLOPs are the blocks' forward linears but
    # w2's, which is what the planner leaves out of a recompute that stops early (Training.checkpoint_early_stop)
    args, s = preset("debug", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=160, vocab_size=128), 32
    tokens = torch.randint(0, args.vocab_size, (2, s))
    flops = {}
    for policy in ("none", "full"):
        model = build_model(args)
        materialize(model, args, "cpu", 0)
        apply_activation_checkpointing(model, policy)
        flops[policy] = _backward_matmul_flops(model, tokens)
    recomputed = flops["full"][1] - flops["none"][1]
    per_token = {name: 2 * n_in * n_out for name, n_in, n_out, _ in linear_shapes(args)}
    assert recomputed == 2 * s * args.n_layers * (sum(per_token.values()) - per_token["w2"])
    assert flops["full"][0] == flops["none"][0]
    # the planner: a recompute that stops early costs the forward less the last linear's share
    training, plan, acc = _training("shardwise"), Plan(activation_checkpoint="full"), accelerator("h100")
    t = layer_times(args, training, plan, acc)
    assert t["matmul_last"] == pytest.approx(layer_times(args, training, plan, acc)["matmul"]
                                             * per_token["w2"] / sum(per_token.values()), rel=0.2)
    early = stage_cost(args, training, plan, Cluster(acc, 1))
    replay = stage_cost(args, dataclasses.replace(training, checkpoint_early_stop=False), plan, Cluster(acc, 1))
    assert replay.recompute - early.recompute == pytest.approx(args.n_layers * t["matmul_last"])


@pytest.fixture
def one_rank_mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_torchs_ddp_keeps_no_copy_of_the_weights(one_rank_mesh, tmp_path):
    """A system on the layout 'torch' whose data parallelism is torch's DDP (fsdp_replicate = false: flash-attn's
    training code) was priced with FSDP2's replicate copy of every weight (4.9 GiB of FlashAttention-2's 1.3B row).
    DDP computes on the module's own parameters: measured, its step (gradients as bucket views) holds what the
    bare model's does, where a copy of the weights would add 44% of this peak; shardwise's own replicate keeps its."""
    from torch.nn.parallel import DistributedDataParallel

    def step_peak(wrap: bool) -> int:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
        if wrap:
            model = DistributedDataParallel(model, gradient_as_bucket_view=True)
        x = torch.randn(8, 512)
        model(x).sum().backward()  # (the gradients exist from here on, as in every later step)
        with PeakBytes() as peak:
            model(x).sum().backward()
        return peak.peak

    bare, ddp = step_peak(False), step_peak(True)
    weights = 4 * (512 * 512 + 512) * 4
    assert ddp == pytest.approx(bare, rel=0.02) and weights > 0.4 * bare
    path = tmp_path / "ddp.toml"
    path.write_text('base = "shardwise"\nfsdp_replicate = false\n')
    args, plan = preset("llama3.2-1b"), Plan(dp_replicate=8, micro_batch=1, grad_accum=1)
    ddp_training = Training(seq_len=2048, global_batch=8, **resolve_system(str(path)).training_fields())
    ours = _training("shardwise", seq_len=2048, global_batch=8)
    assert stage_memory(args, ddp_training, plan, 0)["replica_params"] == 0.0
    assert stage_memory(args, ours, plan, 0)["replica_params"] == pytest.approx(4 * num_params(args))


NANOTRON = Path(__file__).resolve().parents[1] / "benchmarks" / "systems" / "nanotron.toml"
"""nanotron as it ran the Ultra-Scale Playbook's sweep (benchmarks/planner_ultrascale.py)."""


def _nanotron() -> Training:
    return Training(seq_len=4096, global_batch=256, **resolve_system(str(NANOTRON)).training_fields())


def test_torchs_ddp_without_bucket_views_keeps_a_second_copy_of_the_gradients(one_rank_mesh):
    """torch's DistributedDataParallel as it comes (gradient_as_bucket_view=False: how nanotron wraps its model at
    ZeRO-0, and torch's replicate, torchtitan's DDP, wraps it), measured on a bf16 model: a step leaves two copies of
    the gradients, autograd's and the Reducer's buckets it copies them into, where the bare model and DDP with bucket
    views leave one. The planner adds that copy in the weights' dtype (memory.ddp_bucket_copy_bytes) at every moment
    of a step over more than one data-parallel rank, where it prices no buckets in flight besides: nanotron's bf16
    gradients at ZeRO-0 (it wraps in DDP only with dp > 1, and runs ZeRO-1 without it), torchtitan's fp32 ones under
    its DDP, LoRA's adapters alone."""
    from torch.nn.parallel import DistributedDataParallel

    from shardwise.planner.memory import ddp_bucket_bytes

    def held_after_a_step(bucket_view: bool | None) -> float:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]).to(torch.bfloat16)
        with LiveBytes(model) as live:
            wrapped = model if bucket_view is None else DistributedDataParallel(
                model, gradient_as_bucket_view=bucket_view)
            wrapped(torch.randn(8, 512, dtype=torch.bfloat16)).sum().backward()
            held = live.total
        return held / sum(p.numel() * p.element_size() for p in model.parameters())

    bare, views, copies = held_after_a_step(None), held_after_a_step(True), held_after_a_step(False)
    assert views == pytest.approx(bare, abs=0.01) and copies - bare == pytest.approx(1, abs=0.01)
    # torchtitan's apply_ddp: torch's replicate(model, device_mesh, bucket_cap_mb=100), on fp32 weights
    from torch.distributed._composable.replicate import replicate

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    with LiveBytes(model) as live:
        replicate(model, device_mesh=one_rank_mesh, bucket_cap_mb=100)(torch.randn(8, 512)).sum().backward()
        replicated = live.total / sum(p.numel() * p.element_size() for p in model.parameters())
    assert replicated - bare == pytest.approx(1, abs=0.01)
    args = preset("llama3.2-1b")
    nanotron, titan = _nanotron(), _training("torchtitan", seq_len=4096, global_batch=256)
    lora = dataclasses.replace(titan, lora_rank=16)
    cases = [(nanotron, 8, 0, 2 * num_params(args)), (nanotron, 1, 0, 0.0), (nanotron, 8, 1, 0.0),
             (titan, 8, 0, 4 * num_params(args)), (lora, 8, 0, 4 * args.n_layers * lora_params(args, lora, 1)),
             (titan, 8, 1, 4 * num_params(args))]  # (DDP beside a sharded optimizer on a torch layout)
    for training, dp, zero, copy in cases:
        assert not training.ddp_bucket_view
        plan = Plan(dp_replicate=dp, zero_stage=zero, micro_batch=1, grad_accum=256 // dp)
        viewed = dataclasses.replace(training, ddp_bucket_view=True)
        ours, theirs = moment_memory(args, training, plan, 0), moment_memory(args, viewed, plan, 0)
        for moment, items in ours.items():
            assert items.get("ddp_bucket_copy", 0.0) == pytest.approx(copy * (copies - bare), rel=0.01), moment
            # nothing else, but where buckets are in flight (the end of the backward): the copy's, priced once
            in_flight = sum(theirs[moment].values()) - sum(v for k, v in items.items() if k != "ddp_bucket_copy")
            expected = [0.0, ddp_bucket_bytes(viewed, plan)] if copy else [0.0]
            if moment == "end_of_backward":
                expected = expected[-1:]
            assert any(in_flight == pytest.approx(e, abs=1024) for e in expected), moment
    with pytest.raises(PlannerError, match="ddp_bucket_view"):
        Training(layout="fsdp-mp", fsdp_replicate=True, ddp_bucket_view=False)
    with pytest.raises(PlannerError, match="ddp_bucket_view"):
        Training(layout="zero", ddp_bucket_view=False)
    # --layout keeps the copy where torch's DDP stays (nanotron priced as the layout torch), not on Megatron-Core's
    from shardwise.planner.cli import _left_with_the_layout

    assert "ddp_bucket_view" not in _left_with_the_layout(resolve_system(str(NANOTRON)), "torch")
    assert _left_with_the_layout(SYSTEMS["torchtitan"], "megatron")["ddp_bucket_view"]
    assert _left_with_the_layout(resolve_system(str(NANOTRON)), "zero")["ddp_bucket_view"]


def _nanotron_functional():
    """nanotron's tensor-parallel functions (parallel/tensor_parallel/functional.py) from its PyPI wheel, 0.4, whose
    cross-entropy is the Playbook branch's (67c5ebb6), loaded on their own: the package does not import here
    (installed without its dependencies it stops at dacite, through nanotron.logging's import of its config; with
    them its modules import one another in a cycle), so the file runs with torch.distributed for
    nanotron.distributed (its wrapper of it) and the names it imports for other functions stubbed."""
    import importlib.util
    import sys
    import types

    root = Path(importlib.util.find_spec("nanotron").submodule_search_locations[0])
    stubs = {"nanotron": types.ModuleType("nanotron"), "nanotron.distributed": dist}
    for name in ("nanotron.parallel.tensor_parallel.distributed_differentiable_primitives",
                 "nanotron.parallel.tensor_parallel.enum", "nanotron.parallel.utils"):
        stubs[name] = types.ModuleType(name)
        stubs[name].__getattr__ = lambda attr: (lambda f: f)
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location("nanotron_functional",
                                                      root / "parallel" / "tensor_parallel" / "functional.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name)
            else:
                sys.modules[name] = old
    return module


def test_nanotrons_cross_entropy_holds_the_fp32_logits_beside_their_shifted_copy(one_rank_mesh):
    """nanotron's own vocab-parallel cross-entropy on one gloo rank, from the fp32 logits its model's forward
    upcasts (cast_to_fp32) and holds until the loss returns: its forward subtracts the row maximum into a new fp32
    tensor (`sharded_logits - logits_max`), so two fp32 tensors of the logits' size are live at its end, one beyond
    the softmax it saves; its backward adds the bf16 gradient, as Megatron's. Megatron's shifts in place (the test
    above: nothing beyond its softmax in the forward). The planner sizes nanotron's loss by the larger,
    ce_shift_in_place false: 4 bytes a logit beyond the softmax where Megatron-Core's are 2."""
    functional = _nanotron_functional()
    s, v = 256, 1024
    logits = torch.randn(s, 1, v, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, v, (s, 1))
    with PeakBytes() as peak:
        upcast = logits.float()
        loss = functional.sharded_cross_entropy(upcast, target, group=dist.group.WORLD, dtype=torch.float)
        forward = peak.peak
        del upcast  # (the model's forward returns)
        kept = peak.total
        peak.peak = 0
        loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    per_logit = s * v
    assert kept / per_logit == pytest.approx(4, abs=0.05)  # the softmax, fp32 (and the targets)
    assert (forward - kept) / per_logit == pytest.approx(4, abs=0.05)  # the upcast logits beside it
    assert (peak.peak - kept) / per_logit == pytest.approx(2, abs=0.05)  # the bf16 gradient
    args, plan = preset("llama3-8b"), Plan(tp=2, micro_batch=1, sequence_parallel=True)
    tokens, columns = 4096, args.vocab_size / 2
    nanotron, mcore = _nanotron(), _training("megatron-core", seq_len=4096)
    assert not nanotron.ce_shift_in_place and mcore.ce_shift_in_place
    assert logits_bytes(args, nanotron, plan) == pytest.approx(tokens * columns * (forward - kept) / per_logit,
                                                               rel=0.02)
    assert logits_bytes(args, mcore, plan) == tokens * columns * 2
    with pytest.raises(PlannerError, match="ce_shift_in_place"):
        Training(layout="fsdp-mp", loss_parallel=True, ce_shift_in_place=False)
    with pytest.raises(PlannerError, match="ce_shift_in_place"):  # the head fused with the loss: no logits
        Training(layout="megatron", loss_parallel=True, fuse_head=True, ce_shift_in_place=False)


def test_torch_loss_parallel_backward_holds_three_fp32_logit_copies(one_rank_mesh):
    # torchtitan's loss under tp is torch's loss_parallel: its backward is the composite function the DTensor
    # handler calls on each rank's vocabulary shard (torch.distributed.tensor.parallel.loss), measured here on one
    # rank: three fp32 tensors of the log-probabilities' size at once, beside them, where one kernel makes two
    from torch.distributed.tensor.parallel.loss import _nll_loss_and_log_softmax_backward

    n, v = 256, 1024
    log_probs = torch.randn(n, v).log_softmax(-1)
    targets = torch.randint(0, v, (n,))
    with PeakBytes() as peak:
        _nll_loss_and_log_softmax_backward(torch.tensor(1.0), log_probs, targets, None, 1, -100,
                                           torch.tensor(float(n)), log_probs.shape, 1, one_rank_mesh, 0)
    copies = peak.peak / log_probs.nbytes
    assert copies == pytest.approx(3, abs=0.05)
    args, tokens = preset("llama3-70b"), 2 * 8192
    plan = Plan(tp=8, dp_shard=4, zero_stage=3, micro_batch=2, sequence_parallel=True)
    titan, mcore = _training("torchtitan", seq_len=8192), _training("megatron-core", seq_len=8192)
    assert dtensor_loss_parallel(titan, plan) and not dtensor_loss_parallel(mcore, plan)
    assert logits_bytes(args, titan, plan) == tokens * args.vocab_size / 8 * 4 * round(copies)
    assert logits_bytes(args, mcore, plan) == tokens * args.vocab_size / 8 * 2


@pytest.mark.parametrize("fused", [False, True])
def test_megatron_cross_entropy_writes_its_gradient_into_the_saved_softmax(one_rank_mesh, fused):
    # Megatron-Core's own vocab-parallel cross-entropy (megatron-core 0.12, both implementations), on one gloo rank
    # from bf16 logits: its forward keeps an fp32 softmax of the logits' size, and its backward adds only the bf16
    # gradient autograd casts it to; torch's log_softmax + nll_loss adds two fp32 tensors there. The planner sizes
    # Megatron's loss so: the fp32 row among the head's saved tensors, the compute dtype's as its working set
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    parallel_state.initialize_model_parallel(1)
    try:
        group = parallel_state.get_tensor_model_parallel_group()
        s, v = 256, 1024
        logits = torch.randn(s, 1, v, dtype=torch.bfloat16, requires_grad=True)
        target = torch.randint(0, v, (s, 1))
        with PeakBytes() as peak:
            loss = fused_vocab_parallel_cross_entropy(logits, target, group) if fused \
                else vocab_parallel_cross_entropy(logits, target)
            kept = peak.total
            peak.peak = 0
            loss.sum().backward()
        assert logits.grad.dtype == torch.bfloat16
    finally:
        parallel_state.destroy_model_parallel()
    per_logit = s * v
    assert kept / per_logit == pytest.approx(4, abs=0.05)  # the softmax, fp32 (and the targets)
    working = (peak.peak - kept) / per_logit
    assert working == pytest.approx(2, abs=0.05)
    args = preset("llama3-8b")
    plan = Plan(tp=2, micro_batch=1, sequence_parallel=True)
    mcore = _training("megatron-core", seq_len=4096)
    tokens, columns = 4096, args.vocab_size / 2
    assert logits_bytes(args, mcore, plan) == pytest.approx(tokens * columns * working, rel=0.03)
    assert head_activation_bytes(args, mcore, plan) == pytest.approx(
        tokens * (columns * kept / per_logit + 2 * args.dim / 2 + 4 + 8), rel=0.03)


def test_cp_allgather_moves_what_the_engines_context_parallel_attention_moves(one_rank_mesh):
    # shardwise's CP attention (parallel.context_parallel), run on one rank under the comm counter: one all-gather
    # of K and V (the KV heads) in forward, one reduce-scatter of their gradients in backward, each of the bytes
    # the planner's 'allgather' exchange prices (counted here on a group of one, which moves nothing)
    from shardwise.parallel.comm import CommCounter, CommStats
    from shardwise.parallel.context_parallel import context_parallel_attention
    from shardwise.planner.timing import cp_kv_elements

    class EveryGroup(CommStats):
        def add(self, kind, payload, group_size, wire=None):
            self.calls[kind] += 1
            self.payload[kind] += payload

    args = preset("debug", dim=64, n_heads=4, n_kv_heads=2, n_layers=1, vocab_size=128)
    b, s = 2, 32
    q = torch.randn(b, args.n_heads, s, args.head_dim, requires_grad=True)
    k, v = (torch.randn(b, args.n_kv_heads, s, args.head_dim, requires_grad=True) for _ in range(2))
    with CommCounter() as counter:
        counter.stats = EveryGroup()
        context_parallel_attention(q, k, v, group=one_rank_mesh.get_group()).sum().backward()
    training, plan = Training(seq_len=s, global_batch=b, precision="fp32"), Plan(micro_batch=b)
    assert training.cp_exchange == "allgather"
    expected = cp_kv_elements(args, training, plan) * training.act_bytes
    assert dict(counter.stats.calls) == {"all_gather": 1, "reduce_scatter": 1}
    assert dict(counter.stats.payload) == {"all_gather": expected, "reduce_scatter": expected}


def test_float8_tensor_parallel_gathers_what_torchaos_styles_redistribute(one_rank_mesh, monkeypatch):
    # torchtitan's float8 TP: torchao's PrepareFloat8ModuleInput, Float8ColwiseParallel and Float8RowwiseParallel on
    # a float8 MLP, forward and backward on one rank, recording every DTensor redistribution (a group of one moves
    # nothing, but the tensors handed over are the ones a wider group would move): the sequence all-gathers carry
    # float8 (e4m3 in forward, e5m2 gradients in backward), the reduce-scatters bf16, as the planner prices them
    from collections import Counter

    redistribute = pytest.importorskip("torch.distributed.tensor._redistribute")
    pytest.importorskip("torchao.float8")
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    from shardwise.planner.timing import tp_block_bytes

    moved = Counter()
    original = redistribute.redistribute_local_tensor

    def recorded(local, current, target, *args, **kwargs):
        kind = {(Shard, Replicate): "all_gather"}.get((type(current.placements[0]), type(target.placements[0])),
                                                      "reduce_scatter" if current.placements[0].is_partial() else None)
        if kind:
            moved[kind, getattr(local, "_data", local).element_size()] += 1
        return original(local, current, target, *args, **kwargs)

    monkeypatch.setattr(redistribute, "redistribute_local_tensor", recorded)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False), torch.nn.ReLU(),
                              torch.nn.Linear(128, 64, bias=False)).to(torch.bfloat16)
    convert_to_float8_training(mlp)
    parallelize_module(mlp, one_rank_mesh, {
        "": PrepareFloat8ModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "0": Float8ColwiseParallel(), "2": Float8RowwiseParallel(output_layouts=Shard(1))})
    mlp(torch.randn(2, 32, 64, dtype=torch.bfloat16, requires_grad=True)).float().sum().backward()
    assert moved == {("all_gather", 1): 2, ("reduce_scatter", 2): 2}  # forward and backward, one of each
    fp8 = _training("torchtitan", precision="fp8")
    assert tp_block_bytes(fp8) == (1, 2)
    assert tp_block_bytes(_training("torchtitan")) == (2, 2)
    assert tp_block_bytes(_training("megatron-core", precision="fp8")) == (2, 2)  # TE's: not modelled in float8
    # and a block's collectives carry them: priced with one kind's stand-in returning the bytes it is given and the
    # other's nothing, _tp_comm returns the bytes of that kind
    from shardwise.planner import timing

    args, plan = preset("llama3-8b"), Plan(tp=8, micro_batch=1, sequence_parallel=True)
    moved_by = {}
    for training in (fp8, _training("torchtitan")):
        for kind, other in (("all_gather", "reduce_scatter"), ("reduce_scatter", "all_gather")):
            monkeypatch.setattr(timing, kind, lambda size, *_: size)
            monkeypatch.setattr(timing, other, lambda *_: 0.0)
            moved_by[training.precision, kind] = timing._tp_comm(args, training, plan, Cluster(accelerator("h100"), 8),
                                                                 1, False, False)
    x = 4096 * args.dim  # one micro-batch's tokens x d: two gathers and two scatters a block, forward and backward
    assert moved_by == {("fp8", "all_gather"): 4 * x, ("fp8", "reduce_scatter"): 4 * 2 * x,
                        ("bf16", "all_gather"): 4 * 2 * x, ("bf16", "reduce_scatter"): 4 * 2 * x}


TORCHTITAN_SAVE_LIST = ("mm", "_scaled_dot_product_flash_attention_for_cpu", "_c10d_functional.reduce_scatter_tensor",
                        "max")
"""torchtitan's op-level selective policy (models/llama3/parallelize_llama.py at 820504e, June 2025: `_save_list`),
by op name: every op's output kept but every second mm's and all the ops outside the list (its attention ops are
the GPU kernels; the CPU's flash kernel stands in for them here)."""


def _tensor_parallel_replays(layers: int) -> dict:
    """On each of 2 gloo ranks: the engine's model split over tp 2, with and without sequence parallelism, under
    each checkpoint policy (the engine's none, selective and full, and torchtitan's op-level policy applied to the
    same blocks): the collectives of one forward and backward, by kind, and the bytes of the reduce-scatters'
    outputs torchtitan's policy keeps, with and without sequence parallelism."""
    from collections import Counter, defaultdict

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from shardwise.parallel.comm import CommCounter, CommStats
    from shardwise.parallel.tensor_parallel import apply_tensor_parallel

    saved = {getattr(getattr(torch.ops, "_c10d_functional" if "." in name else "aten"),
                     name.split(".")[-1]).default for name in TORCHTITAN_SAVE_LIST}

    def torchtitan_policy(block: torch.nn.Module, sp: bool, moe_blocks: bool) -> None:
        inner = block.forward

        def policy(counts):
            def decide(ctx, func, *args, **kwargs):
                key = "recompute" if ctx.is_recompute else "forward"
                counts[key] += func == torch.ops.aten.mm.default
                keep = func in saved and not (func == torch.ops.aten.mm.default and counts[key] % 2 == 0)
                if keep and key == "forward" and func == torch.ops._c10d_functional.reduce_scatter_tensor.default:
                    kept[sp] += ctx.op_output.nbytes * (not moe_blocks)
                return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
            return decide

        def forward(*args, **kwargs):
            counts = defaultdict(int)
            return checkpoint(inner, *args, use_reentrant=False,
                              context_fn=lambda: create_selective_checkpoint_contexts(policy(counts)), **kwargs)
        block.forward = forward

    class Calls(CommStats):
        def add(self, kind, payload, group_size, wire=None):
            self.calls[kind] += 1

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dense = preset("debug", dim=64, n_heads=4, n_kv_heads=2, n_layers=layers, vocab_size=128)
    moe = preset("debug-moe", dim=64, n_layers=layers, n_dense_layers=0, vocab_size=128)
    out, kept = {}, {False: 0, True: 0}
    for args, sp in ((dense, False), (dense, True), (moe, True)):
        for policy in ("none", "selective", "full", "torchtitan"):
            model = build_model(args)
            apply_tensor_parallel(model, mesh, sp)
            if policy == "torchtitan":
                for block in model.layers.values():
                    torchtitan_policy(block, sp, args.n_experts > 0)
            else:
                apply_activation_checkpointing(model, policy)
            materialize(model, args, "cpu", seed=0)
            with CommCounter() as counter:
                counter.stats = Calls()
                model(torch.randint(0, args.vocab_size, (2, 32))).float().sum().backward()
            out[args.n_experts > 0, sp, policy] = Counter(counter.stats.calls)
    return out, kept


@pytest.mark.multiprocess
def test_selective_recompute_replays_the_collectives_its_policy_does_not_keep(monkeypatch):
    # the engine's tensor-parallel model on 2 ranks: what each checkpoint policy adds to a forward and backward's
    # collectives, against what the planner adds, each of the planner's collectives counted by kind (its all-gather,
    # reduce-scatter and all-reduce stand-ins return 1, 1e3 and 1e6): a block replays its all-gathers and the first
    # reduce-scatter (without sequence parallelism, the first all-reduce) under the engine's selective policy as
    # under full recompute, and only the all-gathers under torchtitan's, which keeps the reduce-scatters' outputs:
    # those are the bytes the planner adds to its activations
    from shardwise.planner import timing
    from shardwise.planner.memory import kept_reduce_scatter_bytes

    layers = 2
    measured, kept = run_distributed(_tensor_parallel_replays, 2, layers)[0]
    monkeypatch.setattr(timing, "all_gather", lambda *_: 1.0)
    monkeypatch.setattr(timing, "reduce_scatter", lambda *_: 1e3)
    monkeypatch.setattr(timing, "all_reduce", lambda *_: 1e6)
    cluster = Cluster(accelerator("h100"), 2)
    for moe, sp in ((False, False), (False, True), (True, True)):
        args = preset("debug-moe" if moe else "debug", dim=64, n_heads=4, n_kv_heads=2, n_layers=layers,
                      vocab_size=128, **({"n_dense_layers": 0} if moe else {}))
        none = measured[moe, sp, "none"]
        for policy in ("selective", "full", "torchtitan"):
            extra = measured[moe, sp, policy] - none
            system = "torchtitan" if policy == "torchtitan" else "shardwise"
            training = _training(system, seq_len=32, global_batch=2, precision="fp32")
            plan = Plan(tp=2, micro_batch=2, sequence_parallel=sp,
                        activation_checkpoint="selective" if policy == "torchtitan" else policy)
            planned = (timing._tp_comm(args, training, plan, cluster, layers, False, False, layers * moe)
                       - timing._tp_comm(args, training, dataclasses.replace(plan, activation_checkpoint="none"),
                                         cluster, layers, False, False, layers * moe))
            assert planned == extra["all_gather"] + 1e3 * extra["reduce_scatter"] + 1e6 * extra["all_reduce"], \
                (moe, sp, policy, dict(extra))
            expected = ({"all_gather": 2, "reduce_scatter": 0 if policy == "torchtitan" else 1} if sp else
                        {"all_reduce": 1})
            assert dict(extra) == {kind: layers * count for kind, count in expected.items() if count}, \
                (moe, sp, policy)
            if policy == "torchtitan" and not moe:
                assert kept[sp] == layers * kept_reduce_scatter_bytes(args, training, plan, 32), (sp, kept)
    assert kept[True] > 0


def test_reentrant_systems_replay_the_whole_forward():
    # Megatron's and DeepSpeed's CheckpointFunction replay the whole forward; torch's non-reentrant checkpoint
    # (this engine, torchtitan's checkpoint_wrapper, llm-foundry's activation_checkpointing_reentrant false,
    # torchtune's apply_activation_checkpointing with torch's NO_REENTRANT default) stops
    stops = {name: system.checkpoint_early_stop for name, system in SYSTEMS.items()}
    assert stops == {"shardwise": True, "torchtitan": True, "megatron-core": False, "megatron-lm-2021": False,
                     "llm-foundry": True, "torchtune": True, "deepspeed": False, "deepspeed-2021": False}


@pytest.mark.parametrize("gpus, published_gib", [(8, 82.4), (128, 67.0)])
def test_torchtitan_llama3_8b_fsdp_memory_against_its_published_benchmark(gpus, published_gib):
    # torchtitan benchmarks/llama3_h100_202412_torchtitan.md, tables 1 and 3, FSDP row: Llama 3.1 8B, local batch
    # 2, sequence 8192, selective (op) checkpointing, eager; peak reserved memory 82.4 GiB on 8 GPUs, 67.0 on 128:
    # what torch's caching allocator holds (reserved_bytes), fragmentation included, though under the expandable
    # segments torchtitan launches with the fit is sized without it
    args = preset("llama3-8b")
    training = _training("torchtitan", seq_len=8192, global_batch=2 * gpus)
    plan = Plan(dp_shard=gpus, zero_stage=3, micro_batch=2, activation_checkpoint="selective")
    ev = evaluate(args, training, plan, Cluster(accelerator("h100"), gpus))
    assert reserved_bytes(args, training, plan, ev.memory_stage) / GiB == pytest.approx(published_gib, rel=0.10)
    assert ev.memory["fragmentation"] == 0.0
    # described as shardwise's engine (fp32 stream, every matmul kept) the same run is sized differently
    ours = evaluate(args, _training("shardwise", seq_len=8192, global_batch=2 * gpus), plan,
                    Cluster(accelerator("h100"), gpus))
    assert ours.memory["activations"] > 1.3 * ev.memory["activations"]


def test_torchtitan_llama3_8b_fsdp_throughput_on_its_500_watt_h100s():
    # the same rows' throughput (5,762 and 5,605 tokens/s per GPU) ran on H100s at a 500 W limit, whose peak the
    # source's footnote puts "between SXM and NVL" (989.4 and 835.5 dense bf16 TFLOP/s, NVIDIA's datasheets):
    # evaluated at the middle of those bounds, each row is within 10%; at the SXM's peak one was 16% optimistic
    published = _published_module()
    assert published.TORCHTITAN_H100_PEAK == pytest.approx((989.4 + 1671 / 2) / 2)
    ratios = {}
    for run in published.torchtitan_runs():
        if run.name not in ("torchtitan 8B FSDP n=8 s=8K", "torchtitan 8B FSDP n=128 s=8K"):
            continue  # (the eager rows; compile and Float8 below)
        ev, fits = published.given_plan(run)
        assert fits and run.peak_tflops == published.TORCHTITAN_H100_PEAK
        assert published.cluster_of(run).accelerator.peak("fp8") == pytest.approx(
            accelerator("h100").peak("fp8") * run.peak_tflops / 989.4)
        ratios[run.name] = run.published_step() / ev.time.step_time_s
        at_sxm_peak = published.given_plan(dataclasses.replace(run, peak_tflops=None))[0]
        assert at_sxm_peak.time.step_time_s < ev.time.step_time_s
    assert len(ratios) == 2 and all(abs(r - 1) <= 0.10 for r in ratios.values()), ratios


def _ns(*argv):
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return parser.parse_args(list(argv))


def test_plan_output_names_the_system(capsys):
    argv = ["--model", "llama3-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "16", "--top-k", "1"]
    assert run_plan(_ns(*argv, "--system", "torchtitan")) == 0
    assert "system: torchtitan - FSDP2 MixedPrecisionPolicy" in capsys.readouterr().out
    assert run_plan(_ns(*argv)) == 0
    assert "system: shardwise - fp32 weights" in capsys.readouterr().out
    assert run_plan(_ns(*argv, "--system", "torchtitan", "--layout", "zero")) == 0
    assert "system: torchtitan (layout zero) - layout zero, head materialised" in capsys.readouterr().out


def test_the_keys_line_leaves_mixed_precision_to_another_system(capsys):
    """`mixed_precision` is a knob of shardwise's engine; another system runs its own recipe (torchtitan's FSDP2
    policy), which the keys line gave as `mixed_precision=autocast`, and `simulate --plan` would have simulated."""
    argv = ["--model", "llama3-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "16", "--top-k", "1",
            "--plan", "dp_shard=8,zero_stage=3"]
    keys = {}
    for system in ("shardwise", "torchtitan"):
        assert run_plan(_ns(*argv, "--system", system)) == 0
        keys[system] = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("#1 as keys"))
    assert "mixed_precision=" in keys["shardwise"] and "mixed_precision" not in keys["torchtitan"]
    assert "dp_shard=8" in keys["torchtitan"] and "zero_stage=3" in keys["torchtitan"]


def test_another_system_is_not_written_as_a_shardwise_config(tmp_path, capsys):
    argv = ["--model", "llama3-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "16", "--top-k", "1",
            "--system", "torchtitan", "--write-config", str(tmp_path / "job.toml")]
    assert run_plan(_ns(*argv)) == 2
    err = capsys.readouterr().err
    assert "--system" in err and "plan with --system shardwise" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "job.toml").exists()


def test_system_toml(tmp_path):
    path = tmp_path / "titan-full-sac.toml"
    path.write_text('base = "torchtitan"\nselective = "matmuls"\n')
    system = resolve_system(str(path))
    assert (system.name, system.layout, system.selective, system.fuse_head) == ("titan-full-sac", "fsdp-mp",
                                                                                 "matmuls", False)


def test_system_toml_distributes_checkpoints(tmp_path):
    from shardwise.planner.cli import system_summary

    path = tmp_path / "megatron-2021-dca.toml"
    path.write_text('base = "megatron-lm-2021"\ndistribute_checkpoints = true\nkeeps_bf16_grads = true\n')
    system = resolve_system(str(path))
    assert system.distribute_checkpoints and not SYSTEMS["megatron-lm-2021"].distribute_checkpoints
    training = Training(seq_len=2048, global_batch=8, **system.training_fields())
    assert training.distribute_checkpoints and training.keeps_bf16_grads
    assert system_summary(training).endswith(
        ", checkpoints split over tp, bf16 gradients kept beside fp32, gradients reduced after the backward; no "
        "context parallelism; no expert parallelism; pipeline schedules 1f1b, interleaved-1f1b; ZeRO-0, 1 over "
        "data-parallel ranks; no host offload of the weights")


def test_megatron_main_gradients_in_the_weights_dtype(tmp_path):
    # NeMo 2's performance recipes set the precision plugin's grad_reduce_in_fp32=False, which overrides the DDP
    # config's (nemo/lightning/pytorch/plugins/mixed_precision.py): Megatron-Core's main-gradient buffer is then bf16,
    # 2 bytes a parameter where Megatron-LM's --accumulate-allreduce-grads-in-fp32 keeps 4, and its data-parallel
    # reduce-scatter carries bf16
    from shardwise.planner.comm import axis_link, reduce_scatter
    from shardwise.planner.memory import stage_memory

    args = preset("llama3-8b")
    plan = Plan(dp_replicate=8, zero_stage=1, micro_batch=1, grad_accum=1)
    fp32 = _training("megatron-core", global_batch=8)
    bf16 = dataclasses.replace(fp32, grads_in_fp32=False)
    n = num_params(args)
    assert stage_memory(args, fp32, plan, 0)["grads"] == pytest.approx(4 * n)
    assert stage_memory(args, bf16, plan, 0)["grads"] == pytest.approx(2 * n)
    # at the step the optimizer upcasts them for its fp32 master (DistributedOptimizer: main_grad.float()): a
    # transient of the master's size, which fp32 main gradients do not need
    from shardwise.planner.memory import moment_memory
    step32 = moment_memory(args, fp32, plan, 0)["optimizer_step"]
    step16 = moment_memory(args, bf16, plan, 0)["optimizer_step"]
    assert step32["backward_and_logits"] == 0.0
    assert step16["backward_and_logits"] == pytest.approx(step16["master_weights"]) == pytest.approx(4 * n / 8)
    cluster = Cluster(accelerator("h100"), 8)
    ranks, link = axis_link(plan, ("dp_replicate",), cluster)
    saved = (evaluate(args, fp32, plan, cluster).time.detail["dp_comm_s"]
             - evaluate(args, bf16, plan, cluster).time.detail["dp_comm_s"])
    assert saved == pytest.approx(reduce_scatter(4 * n, ranks, link) - reduce_scatter(2 * n, ranks, link), rel=0.1)
    # a system file says so; any other layout keeps its gradients as it keeps them, and says why
    path = tmp_path / "nemo-perf.toml"
    path.write_text('base = "megatron-core"\ngrads_in_fp32 = false\n')
    training = Training(seq_len=4096, global_batch=8, **resolve_system(str(path)).training_fields())
    assert not training.grads_in_fp32
    from shardwise.planner.cli import system_summary
    assert ", main gradients in the weights dtype" in system_summary(training)
    with pytest.raises(PlannerError, match="grads_in_fp32"):
        dataclasses.replace(_training("torchtitan"), grads_in_fp32=False)


def test_apex_distributed_adam_state_in_bf16(tmp_path):
    # NeMo 1's Nemotron-4 340B configs set optim.dtype bf16 (Apex's DistributedFusedAdam dtype) and grad_sync_dtype
    # bf16. NeMo sets store_params from it (megatron_base_model.py, v2.0.0rc0): False where the optimizer's dtype is
    # the weights' (no master: the update goes to the bf16 weight shards), True under fp8_params (a master in the
    # optimizer's dtype, bf16). Per parameter on a rank of dp d: weights 2 + gradients 2 + moments 2 x 2 / d, plus a
    # bf16 master 2 / d in float8, against 4 / d of fp32 master and 8 / d of fp32 moments in fp32
    from shardwise.planner.memory import moment_memory, stage_memory

    args = preset("llama3-8b")
    plan = Plan(dp_replicate=8, zero_stage=1, micro_batch=1, grad_accum=1)
    n, d = num_params(args), 8
    fp32 = dataclasses.replace(_training("megatron-core"), grads_in_fp32=False)
    bf16 = dataclasses.replace(fp32, optimizer_dtype="bf16")
    fp8 = dataclasses.replace(bf16, precision="fp8", float8="te-delayed")
    for training, master, moments in ((fp32, 4, 8), (bf16, 0, 4), (fp8, 2, 4)):
        state = stage_memory(args, training, plan, 0)
        assert state["params"] == pytest.approx(2 * n) and state["grads"] == pytest.approx(2 * n)
        assert state["master_weights"] == pytest.approx(master * n / d), training.precision
        assert state["optimizer_state"] == pytest.approx(moments * n / d), training.precision
    # Apex's kernel updates in place: no fp32 copy of the gradients at the step, even beside fp8's bf16 master
    # (Megatron's optimizer makes one of the master's size, which fp32 state still gets)
    assert moment_memory(args, fp8, plan, 0)["optimizer_step"]["backward_and_logits"] == 0.0
    assert moment_memory(args, fp32, plan, 0)["optimizer_step"]["backward_and_logits"] == pytest.approx(4 * n / d)
    # a system file says so; anything but Megatron's layout with AdamW in mixed precision is refused, naming it
    path = tmp_path / "nemo1-340b.toml"
    path.write_text('base = "megatron-core"\noptimizer_dtype = "bf16"\n')
    edited = Training(seq_len=4096, global_batch=8, **resolve_system(str(path)).training_fields())
    assert edited.optimizer_dtype == "bf16"
    from shardwise.planner.cli import system_summary
    assert ", AdamW state in bf16 (Apex)" in system_summary(edited)
    for wrong, flag in ((_training("torchtitan"), "--system optimizer_dtype"),
                        (dataclasses.replace(fp32, optimizer="adamw8bit"), "--optimizer"),
                        (dataclasses.replace(fp32, precision="fp32"), "--precision"),
                        (dataclasses.replace(fp32, precision="fp16"), "--precision")):
        with pytest.raises(PlannerError, match="optimizer_dtype") as refused:
            dataclasses.replace(wrong, optimizer_dtype="bf16")
        assert refused.value.field == flag
    path.write_text('base = "megatron-core"\noptimizer_dtype = "fp16"\n')
    with pytest.raises(PlannerError, match="optimizer_dtype"):
        resolve_system(str(path))


def test_deepspeed_copies_gradients_into_its_buckets_on_the_compute_stream_below_zero_3():
    # DeepSpeed's contiguous gradients: each gradient hook copies the gradient into the reduction bucket (read and
    # written in bf16), on the current stream at ZeRO-1/2 (stage_1_and_2.py) and on its reduce_and_partition_stream
    # at ZeRO-3 (stage3.py); a tensor larger than the bucket is reduced where it lies (Llama 3 8B's embedding and
    # head, 525M elements against 5e8). On the catalogue H100 (comm_overlap 1) ZeRO-2's copies cost their bytes at
    # memory bandwidth every micro-batch, ZeRO-3's nothing; DeepSpeed of 2021 (contiguous_gradients off) none
    from shardwise.planner.memory import layer_params
    from shardwise.planner.timing import sharding_copies

    args, acc = preset("llama3-8b"), accelerator("h100")
    ds = _training("deepspeed", seq_len=2048, global_batch=32)
    assert args.vocab_size * args.dim > ds.reduce_bucket_size
    blocks = args.n_layers * layer_params(args)
    bandwidth = acc.mem_bandwidth * acc.bandwidth_efficiency
    for stage in (1, 2):
        plan = Plan(dp_shard=8, zero_stage=stage, micro_batch=1, grad_accum=4)
        assert sharding_copies(args, ds, plan, acc) == pytest.approx(4 * blocks * (2 + 2) / bandwidth, rel=1e-9)
    plan = Plan(dp_shard=8, zero_stage=3, micro_batch=1, grad_accum=4)
    assert sharding_copies(args, ds, plan, acc) == 0.0
    assert sharding_copies(args, ds, plan, dataclasses.replace(acc, comm_overlap=0.0)) > 0.0
    assert sharding_copies(args, dataclasses.replace(_training("deepspeed-2021"), seq_len=2048), plan, acc) == 0.0


def test_deepspeed_gradient_buckets_by_hand(tmp_path):
    # DeepSpeed's contiguous_gradients buckets (zero/config.py: reduce_bucket_size 5e8 elements by default): ZeRO-3
    # allocates one per dtype at initialisation and keeps it (stage3.py, ipg_buckets' buffer: 1 GB in bf16), ZeRO-1 and
    # 2 one at the first gradient hook of each backward, two under overlap_comm, freed at the backward's end
    # (stage_1_and_2.py setup_buckets, _release_ipg_buffers). Every moment but the loss's backward (before any
    # gradient) and the optimizer step holds ZeRO-2's; every moment ZeRO-3's. DeepSpeed of 2021 (contiguous_gradients
    # off then) and the other layouts have none, and a system file asking for them elsewhere is refused
    from shardwise.planner.memory import moment_memory, zero_bucket_bytes

    args = preset("llama3-8b")
    ds = _training("deepspeed", seq_len=2048, global_batch=8)
    assert ds.reduce_bucket_size == 5e8 and not ds.overlap_comm
    bucket = 5e8 * 2
    assert zero_bucket_bytes(ds, Plan(dp_shard=8, zero_stage=0)) == (0.0, 0.0)  # plain data parallelism: torch's DDP
    for stage, overlap, kept, in_backward in ((3, False, bucket, 0.0), (2, False, 0.0, bucket),
                                              (2, True, 0.0, 2 * bucket), (1, True, 0.0, 2 * bucket)):
        training = dataclasses.replace(ds, overlap_comm=overlap)
        plan = Plan(dp_shard=8, zero_stage=stage, micro_batch=1, grad_accum=1, activation_checkpoint="full")
        moments = moment_memory(args, training, plan, 0)
        for name, items in moments.items():
            during = name not in ("loss_backward", "optimizer_step")
            assert items["ddp_buckets"] == kept + (in_backward if during else 0.0), (stage, overlap, name)
    # with accumulation the moments of a later micro-batch hold them too (ZeRO-3's always; ZeRO-2's in each backward)
    accumulating = moment_memory(args, dataclasses.replace(ds, overlap_comm=True),
                                 Plan(dp_shard=8, zero_stage=2, micro_batch=1, grad_accum=4), 0)
    assert accumulating["end_of_backward"]["ddp_buckets"] == 2 * bucket
    assert accumulating["optimizer_step"]["ddp_buckets"] == 0.0
    old = dataclasses.replace(_training("deepspeed-2021"), seq_len=2048)
    plan = Plan(dp_shard=8, zero_stage=3, micro_batch=1, grad_accum=1, activation_checkpoint="full")
    assert old.reduce_bucket_size == 0
    assert all(m["ddp_buckets"] == 0 for m in moment_memory(args, old, plan, 0).values())
    # without DeepSpeed's buckets ZeRO-1 keeps the DDP buckets it had (two of 25 MB at the end of backward)
    zero1 = moment_memory(args, old, dataclasses.replace(plan, zero_stage=1), 0)
    assert zero1["end_of_backward"]["ddp_buckets"] == 2 * 25 * 2**20
    path = tmp_path / "deepspeed-hf.toml"
    path.write_text('base = "deepspeed"\noverlap_comm = true\nreduce_bucket_size = 200000000\n')
    system = resolve_system(str(path))
    assert (system.reduce_bucket_size, system.overlap_comm) == (2e8, True)
    for wrong in (_training("torchtitan"), _training("megatron-core")):
        with pytest.raises(PlannerError, match="reduce_bucket_size") as refused:
            dataclasses.replace(wrong, reduce_bucket_size=5e8)
        assert refused.value.field == "--system reduce_bucket_size"


def _composite_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    # torch's CompositeImplicitAutograd rms_norm before its fused kernel (aten/src/ATen/native/layer_norm.cpp, torch
    # 2.4-2.7), written out: "upcast is needed for fp16 and bf16"
    upcast = x.to(torch.float32)
    rstd = torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + eps)
    return (upcast * rstd).type_as(x) * weight


def test_composite_rmsnorm_saves_its_fp32_upcast():
    # the planner's composite norm (fused_rmsnorm False: torchtitan's 2024 eager runs, Hugging Face's Llama without
    # Liger-Kernel) against what autograd saves, measured: Hugging Face's LlamaRMSNorm and torch's composite
    # rms_norm each keep the fp32 input, the fp32 rstd and x * rstd in bf16, 6 bytes an element beside the
    # fused kernel's bf16 input (the norm's output, which the next linear keeps, is counted with that linear)
    transformers_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from shardwise.planner.memory import _norm_terms

    d, tokens = 64, 16
    x = torch.randn(1, tokens, d, dtype=torch.bfloat16, requires_grad=True)
    hf = transformers_llama.LlamaRMSNorm(d).to(torch.bfloat16)
    weight = torch.ones(d, dtype=torch.bfloat16, requires_grad=True)
    plan = Plan(micro_batch=1)
    for norm in (hf, lambda t: _composite_rms_norm(t, weight)):
        saved = {}
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.setdefault((t.data_ptr(), t.dtype, t.shape), t.numel() * t.element_size()) and t,
                lambda t: t):
            norm(x).float().sum().backward()
        per_token = sum(b for (_, _, shape), b in saved.items() if shape[:2] == (1, tokens)) / tokens
        for composite in (True, False):
            training = dataclasses.replace(_training("deepspeed"), fused_rmsnorm=not composite)
            terms = [t for t in _norm_terms("norm", d, training, autocast_copies=1) if not t.name.endswith("output")]
            planned = sum(term_bytes(t, preset("debug"), training, plan) for t in terms)
            assert planned == (per_token if composite else 2 * d + 4), (norm, composite)
        assert per_token == 6 * d + 4
    # compiled, the composite norm is one generated kernel: the partitioner keeps the bf16 input and rstd, as the
    # fused kernel does, and recomputes the upcast (torchtitan's compiled rows)
    saved = {}
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.setdefault((t.data_ptr(), t.dtype, t.shape), t.numel() * t.element_size()) and t,
            lambda t: t):
        torch.compile(_composite_rms_norm)(x, weight).float().sum().backward()
    per_token = sum(b for (_, _, shape), b in saved.items() if shape[:2] == (1, tokens)) / tokens
    compiled = dataclasses.replace(_training("torchtitan"), fused_rmsnorm=False, compile=True)
    terms = [t for t in _norm_terms("norm", d, compiled, autocast_copies=1) if not t.name.endswith("output")]
    assert per_token == sum(term_bytes(t, preset("debug"), compiled, plan) for t in terms) == 2 * d + 4


def _fsdp1_reduce_dtypes(mixed: dict) -> tuple[torch.dtype, torch.dtype, bool]:
    # FSDP1 as Composer wraps a unit: the dtype its gradient is reduced in, the sharded gradient's dtype, and whether
    # backward joins the weights' gradients into the flat one (their views' SplitWithSizesBackward: a cat)
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

    unit = FullyShardedDataParallel(torch.nn.Linear(8, 8), mixed_precision=MixedPrecision(**mixed),
                                    device_id=torch.device("cpu"))
    loss = unit(torch.randn(4, 8)).float().sum()
    nodes, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in nodes:
            nodes.add(node)
            stack += [child for child, _ in node.next_functions]
    loss.backward()
    joins = "SplitWithSizesBackward0" in {type(node).__name__ for node in nodes}
    return unit._handle._reduce_dtype, next(unit.parameters()).grad.dtype, joins


@pytest.mark.multiprocess
def test_fsdp1_reduces_in_bf16_under_composers_pure_and_its_early_default():
    # Composer's FSDP mixed precision (composer/trainer/mosaic_fsdp.py): PURE sets param, reduce and buffer dtypes to
    # bf16; DEFAULT sets param and buffer dtypes in 0.14-0.16 and no reduce dtype, which FSDP1 takes from the param
    # dtype; 0.17 sets reduce_dtype fp32. Torch's own FSDP1 on one gloo rank resolves them so, the sharded gradient
    # staying fp32: the planner's reduce_dtype bf16 (llm-foundry's tables but the large-scale H100 one). Its weights
    # are views of the flat parameter, whose gradient backward joins from theirs (timing.sharding_copies)
    bf16, fp32 = torch.bfloat16, torch.float32
    default_016 = {"param_dtype": bf16, "buffer_dtype": bf16}
    measured = run_distributed(_fsdp1_reduce_dtypes, 1, default_016)[0]
    assert measured == (bf16, fp32, True)
    assert run_distributed(_fsdp1_reduce_dtypes, 1, {**default_016, "reduce_dtype": fp32})[0] == (fp32, fp32, True)


def test_hsdp_all_reduces_behind_the_backward_under_torchs_fsdp():
    # Hybrid sharding's all-reduce across replicas: torch's FSDP issues each unit's after its reduce-scatter on a
    # stream of its own (FSDP1's _reduce_grad, read here; FSDP2's foreach_reduce), as often as the reduce-scatter, so
    # it hides behind the backward with it; DeepSpeed's MiCS all-reduces once a step, at the accumulation boundary
    # (priced exposed). Llama 3 8B at 8 x 8 H100s against the same ranks' FSDP over one node: the difference in
    # traffic is the all-reduce by hand (torchtitan, which reduces every micro-batch: twice, unit by unit;
    # DeepSpeed: once)
    import inspect

    from torch.distributed.fsdp import _runtime_utils

    from shardwise.planner.comm import all_reduce, axis_link

    assert "_all_reduce_stream" in inspect.getsource(_runtime_utils._reduce_grad)
    args = preset("llama3-8b")
    cluster = Cluster(accelerator("h100"), 64)
    # (system, bytes a parameter reduced, all-reduces a step of two micro-batches, hidden): torchtitan reduces
    # every micro-batch, shardwise once a step, both unit by unit; DeepSpeed once, the whole shard
    for system, nbytes, times, hidden in (("torchtitan", 4, 2, True), ("shardwise", 4, 1, True),
                                          ("deepspeed", 2, 1, False)):
        for zero in (2, 3):
            hsdp = Plan(dp_replicate=8, dp_shard=8, zero_stage=zero, micro_batch=1, grad_accum=2)
            n, link = axis_link(hsdp, ("dp_replicate",), cluster, spread=True)
            one_node = evaluate(args, _training(system, seq_len=4096, global_batch=16),
                                Plan(dp_shard=8, zero_stage=zero, micro_batch=1, grad_accum=2),
                                Cluster(accelerator("h100"), 8)).time.detail
            hybrid = evaluate(args, _training(system, seq_len=4096, global_batch=128), hsdp, cluster).time.detail
            if hidden:
                by_hand = sum(count * all_reduce(nbytes * p / 8, n, link) for count, p in _fsdp_units(args))
            else:
                by_hand = all_reduce(nbytes * num_params(args) / 8, n, link)
            added = hybrid["dp_comm_s"] - one_node["dp_comm_s"]
            exposed = hybrid["dp_exposed_s"] - one_node["dp_exposed_s"]
            assert added == pytest.approx(times * by_hand, rel=1e-9), (system, zero)
            assert exposed < 0.5 * added if hidden else exposed == pytest.approx(added, rel=1e-9), (system, zero)


def test_fused_projections_keep_one_autocast_copy_of_the_norms_output():
    # Under autocast over an fp32 residual stream (the layout torch) each linear reading a norm's output casts it
    # and keeps its own bf16 copy for its weight's gradient: separate q, k and v (shardwise's, Hugging Face's) keep
    # three, one Wqkv (flash-attn's, lit-gpt's) one; separate w1 and w3 two, one linear for both one. Measured on
    # torch's CPU autocast; the planner's norm-output terms (copies x d x 2 bytes a token) follow
    # (Training.fused_projections), and a bf16 stream shares one copy either way
    d, tokens = 64, 32

    def kept_bf16_copies(linears) -> int:
        # the norm's fp32 output: not a leaf (autocast caches the casts of leaves that need a gradient, its weights)
        x = torch.randn(tokens, d, requires_grad=True) * 1.0
        kept = set()

        def pack(t):
            if t.dtype == torch.bfloat16 and tuple(t.shape) == (tokens, d):
                kept.add(t.untyped_storage().data_ptr())
            return t

        with torch.autocast("cpu", dtype=torch.bfloat16), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            outputs = [linear(x) for linear in linears]  # (their graphs, and what they keep, alive)
        assert len(outputs) == len(linears)
        return len(kept)

    def linears(n: int, width: int):
        return [torch.nn.Linear(d, width, bias=False) for _ in range(n)]

    assert (kept_bf16_copies(linears(3, d)), kept_bf16_copies(linears(1, 3 * d))) == (3, 1)
    assert (kept_bf16_copies(linears(2, d)), kept_bf16_copies(linears(1, 2 * d))) == (2, 1)
    args, plan = preset("debug"), Plan(micro_batch=2)
    for system, fewer in (("shardwise", (3 - 1) + (2 - 1)), ("torchtitan", 0)):
        separate = _training(system, seq_len=256, global_batch=2)
        fused = dataclasses.replace(separate, fused_projections=True)
        saved = [layer_activation_bytes(args, t, plan, "none") for t in (separate, fused)]
        assert saved[0] - saved[1] == 2 * 256 * args.dim * 2 * fewer


@pytest.mark.multiprocess
def test_lightnings_bf16_mixed_fsdp_reduces_fp32_gradients_in_bf16(tmp_path):
    # Lightning's FSDP under precision "bf16-mixed" (lightning/fabric/plugins/precision/fsdp.py: param_dtype fp32,
    # reduce_dtype bf16, the step under autocast; TinyLlama's pretraining): torch's FSDP1 on one gloo rank reduces
    # in bf16 and keeps the gradients fp32. A system file states it as the layout torch (fp32 weights under
    # autocast) with reduce_dtype bf16: the reduce-scatters move 2 bytes a parameter where shardwise's move 4 (by
    # hand), the gathers are the same fp32 ones, and the gradients kept unsharded between micro-batches
    # (no_backward_sync) stay fp32, 4 bytes a parameter, as shardwise's are
    from shardwise.planner.memory import block_params, moment_memory

    bf16, fp32 = torch.bfloat16, torch.float32
    lightning_mp = {"param_dtype": fp32, "reduce_dtype": bf16, "buffer_dtype": bf16}
    assert run_distributed(_fsdp1_reduce_dtypes, 1, lightning_mp)[0] == (bf16, fp32, True)
    path = tmp_path / "lightning-bf16-mixed.toml"
    path.write_text('base = "shardwise"\nreduce_dtype = "bf16"\n')
    lightning = Training(seq_len=2048, global_batch=128, **resolve_system(str(path)).training_fields())
    ours = _training("shardwise", seq_len=2048, global_batch=128)
    assert (lightning.layout, lightning.reduce_dtype, lightning.stream_bytes) == ("torch", "bf16", 4)
    args = ModelArgs(name="tinyllama-like", dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, vocab_size=32000,
                     ffn_hidden=5632, max_seq_len=2048)
    plan = Plan(dp_shard=16, zero_stage=3, micro_batch=8)
    cluster = Cluster(accelerator("a100-40gb"), 16)
    times = [evaluate(args, t, plan, cluster).time.detail["dp_comm_s"] for t in (ours, lightning)]
    assert times[0] - times[1] == pytest.approx(_bf16_reduction_saving(args, plan, cluster), rel=1e-9)
    accumulating = Plan(dp_shard=16, zero_stage=3, micro_batch=2, grad_accum=4)
    held = [moment_memory(args, t, accumulating, 0)["end_of_backward"]["fsdp_buffers"] for t in (ours, lightning)]
    assert held[1] == held[0] >= num_params(args) * 4
    # ... while the reduce-scatter's input is the bf16 cast: a block's backward leaves 2 bytes a parameter in FSDP's
    # buffers where shardwise's leaves 4
    for t, nbytes in ((ours, 4), (lightning, 2)):
        moments = moment_memory(args, t, plan, 0)
        grown = moments["second_block_backward"]["fsdp_buffers"] - moments["first_block_backward"]["fsdp_buffers"]
        assert grown == pytest.approx(nbytes * block_params(args, 1), rel=1e-12)
    # shardwise's engine reduces in fp32 under autocast and under its own policy: it is refused there, as is a bf16
    # reduction in an fp32 run
    for wrong in (ours, dataclasses.replace(lightning, reduce_dtype="fp32", precision="fp32")):
        with pytest.raises(PlannerError, match="reduce_dtype") as refused:
            dataclasses.replace(wrong, reduce_dtype="bf16")
        assert refused.value.field == "--system reduce_dtype"
    # shardwise's FSDP2 policy (mixed_precision fsdp: bf16 gathers) is its engine's knob: the search tries it for
    # shardwise, never for a system file on the same layout, and --plan asking for it there is refused by name
    from shardwise.planner import search
    assert search(args, ours, cluster, top_k=1).ranked[0].plan.mixed_precision == "fsdp"
    assert search(args, lightning, cluster, top_k=1).ranked[0].plan.mixed_precision == "autocast"
    with pytest.raises(PlannerError, match="mixed_precision") as refused:
        search(args, lightning, cluster, fixed={"mixed_precision": "fsdp", "zero_stage": 3}, top_k=1)
    assert refused.value.field == "--plan mixed_precision"


def test_a_bf16_reduction_halves_the_reduce_scatter_by_hand(tmp_path):
    # FSDP's bf16 reduction (Training.reduce_dtype) moves each reduce-scatter in 2 bytes a parameter, unit by unit, and
    # keeps the 4-byte gradient state; plans that do not shard run it under autocast (fp32 gradients), and a whole
    # search with it runs; --layout away from fsdp-mp leaves it behind
    from shardwise.planner.memory import stage_memory
    from shardwise.planner.workload import recipe_for

    args = ModelArgs(name="mpt-13b-like", dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, vocab_size=50368,
                     mlp="gelu", ffn_hidden=4 * 5120, tie_embeddings=True, max_seq_len=2048)
    composer_017 = _training("llm-foundry", seq_len=2048, global_batch=128)
    composer_016 = dataclasses.replace(composer_017, reduce_dtype="bf16")
    plan = Plan(dp_shard=64, zero_stage=3, micro_batch=2)
    cluster = Cluster(accelerator("h100"), 64)
    times = [evaluate(args, t, plan, cluster).time.detail["dp_comm_s"] for t in (composer_017, composer_016)]
    assert times[0] - times[1] == pytest.approx(_bf16_reduction_saving(args, plan, cluster), rel=1e-9)
    assert stage_memory(args, composer_016, plan, 0)["grads"] == stage_memory(args, composer_017, plan, 0)["grads"]
    # FSDP's mixed-precision layout in a mixed-precision run has it (torchtitan's too: its mixed_precision_reduce),
    # and a system file may set it; the other layouts and an fp32 run are refused, naming the field
    assert dataclasses.replace(_training("torchtitan"), reduce_dtype="bf16").reduce_dtype == "bf16"
    path = tmp_path / "llm-foundry-composer-0.16.toml"
    path.write_text('base = "llm-foundry"\nreduce_dtype = "bf16"\n')
    assert resolve_system(str(path)).training_fields()["reduce_dtype"] == "bf16"
    from shardwise.planner.cli import system_summary
    assert ", gradients reduced in bf16" in system_summary(composer_016)
    for wrong in (_training("megatron-core"), _training("deepspeed"),
                  dataclasses.replace(composer_017, precision="fp32"),
                  dataclasses.replace(composer_017, precision="fp16")):  # an fp16 run reduces in fp16 (metaseq's)
        with pytest.raises(PlannerError, match="reduce_dtype") as refused:
            dataclasses.replace(wrong, reduce_dtype="bf16")
        assert refused.value.field == "--system reduce_dtype"
    fp16 = dataclasses.replace(composer_017, precision="fp16", reduce_dtype="fp16")
    assert evaluate(args, fp16, plan, cluster).time.detail["dp_comm_s"] == pytest.approx(times[1], rel=1e-12)
    for unsharded in (Plan(dp_replicate=8, zero_stage=0), Plan(dp_replicate=8, zero_stage=1), Plan()):
        assert recipe_for(composer_016, unsharded).reduce_dtype == "fp32"
    argv = ["--model", "debug", "--gpus", "2", "--seq-len", "256", "--global-batch", "8", "--top-k", "1"]
    assert run_plan(_ns(*argv, "--system", str(path))) == 0
    from shardwise.planner.cli import system_of
    for layout, kept in (("zero", "fp32"), ("fsdp-mp", "bf16"), ("torch", "fp32")):
        assert system_of(_ns(*argv, "--system", str(path), "--layout", layout)).reduce_dtype == kept
    assert run_plan(_ns(*argv, "--system", str(path), "--layout", "zero")) == 0
    for preset_name in ("deepspeed", "megatron-core", "llm-foundry"):  # each left for every other layout
        for layout in ("torch", "fsdp-mp", "megatron", "zero"):
            Training(seq_len=256, global_batch=8,
                     **system_of(_ns(*argv, "--system", preset_name, "--layout", layout)).training_fields())


def test_megatron_core_overlaps_the_interleaved_steady_states_pipeline_sends():
    # Megatron-Core's interleaved schedule with --overlap-p2p-communication (Megatron-LM's default there, NeMo's
    # wherever virtual stages > 1) waits on a steady-state chunk's send and receive only after the next chunk's
    # compute; its warm-up forwards and cool-down backwards send and receive blocking. On pipeline rank r the
    # warm-up is (p - r - 1) 2 + (v - 1) p of the m v chunks (schedules.py, num_warmup_microbatches, core_r0.11)
    from shardwise.planner.timing import _pp_p2p, _pp_p2p_bytes_time, pp_overlap_share

    args = preset("llama3-70b")
    mcore = _training("megatron-core", seq_len=8192, global_batch=64)
    titan = _training("torchtitan", seq_len=8192, global_batch=64)
    assert mcore.pp_overlap_p2p and not titan.pp_overlap_p2p
    cluster = Cluster(accelerator("h100"), 256)
    plan = Plan(tp=8, pp=8, virtual_stages=5, pp_schedule="interleaved-1f1b", dp_replicate=4, micro_batch=1,
                grad_accum=16, sequence_parallel=True)
    whole = _pp_p2p_bytes_time(args, mcore, plan, cluster)
    for rank in (0, 7):
        warmup = (8 - rank - 1) * 2 + (5 - 1) * 8
        assert pp_overlap_share(mcore, plan, rank) == pytest.approx(warmup / (16 * 5))
        assert _pp_p2p(args, mcore, plan, cluster, rank) == pytest.approx(whole * warmup / 80)
    # fewer micro-batches than the warm-up holds: every send blocks; 1F1B and the other systems' schedules block
    few = dataclasses.replace(plan, grad_accum=4)
    assert pp_overlap_share(mcore, few, 0) == 1.0
    assert pp_overlap_share(mcore, dataclasses.replace(plan, pp_schedule="1f1b", virtual_stages=1), 0) == 1.0
    assert pp_overlap_share(titan, plan, 0) == 1.0
    with pytest.raises(PlannerError, match="pp_overlap_p2p"):  # torch's pipelining schedules block
        dataclasses.replace(titan, pp_overlap_p2p=True)
    assert _pp_p2p(args, titan, plan, cluster, 0) == pytest.approx(_pp_p2p_bytes_time(args, titan, plan, cluster))
    # and the step prices it so: the rank it costs (the heaviest) pays its warm-up's share
    step = evaluate(args, mcore, plan, cluster).time.detail["pp_p2p_s"]
    blocking = evaluate(args, dataclasses.replace(mcore, pp_overlap_p2p=False), plan, cluster).time.detail["pp_p2p_s"]
    assert step < blocking / 2
    assert any(step == pytest.approx(blocking * pp_overlap_share(mcore, plan, rank)) for rank in range(8))


def test_torch_context_parallel_exchange_by_hand(tmp_path):
    # torch's context_parallel as torchtitan runs it: K and V all-gathered in forward, in the recomputed forward
    # and in backward, dK and dV handed on in fp32 at each of the cp steps; compiled blocks expose all of it.
    # Under its model of 2024 (repeat_kv before SDPA) the K and V are every query head's: n_rep times the bytes
    from shardwise.planner.comm import all_gather, axis_link, p2p
    from shardwise.planner.timing import _cp_exposed

    args, cp, seq = preset("llama3-8b"), 4, 131072
    plan = Plan(cp=cp, dp_shard=2, zero_stage=3, micro_batch=1, activation_checkpoint="full")
    cluster = Cluster(accelerator("h100"), 8)
    n, link = axis_link(plan, ("cp",), cluster)
    exposed = {}
    for repeats in (False, True):
        training = dataclasses.replace(_training("torchtitan", seq_len=seq), compile=True, cp_repeats_kv=repeats)
        heads = args.n_heads if repeats else args.n_kv_heads
        chunk = seq / cp * 2 * heads * args.head_dim
        by_hand = args.n_layers * (3 * all_gather(cp * chunk * 2, n, link) + cp * p2p(chunk * 4, link))
        exposed[repeats] = _cp_exposed(args, training, plan, cluster, args.n_layers, 1.0, 2.5)
        assert exposed[repeats] == pytest.approx(by_hand)
    assert exposed[True] > 3 * exposed[False]
    # eager blocks overlap it with the attention it serves, as the ring does; the ring is the default elsewhere
    eager = dataclasses.replace(_training("torchtitan", seq_len=seq), cp_repeats_kv=True)
    assert _cp_exposed(args, eager, plan, cluster, args.n_layers, 1.0, 2.5) < exposed[True]
    assert (SYSTEMS["torchtitan"].cp_exchange, SYSTEMS["megatron-core"].cp_exchange) == ("torch", "ring")
    # shardwise's own (parallel.context_parallel): K and V at the KV heads all-gathered, in forward and in the
    # recomputed forward, their gradients reduce-scattered, all blocking
    from shardwise.planner.comm import reduce_scatter

    ours = _training("shardwise", seq_len=seq)
    gathered = seq * 2 * args.n_kv_heads * args.head_dim * 2
    assert ours.cp_exchange == "allgather"
    assert _cp_exposed(args, ours, plan, cluster, args.n_layers, 1.0, 2.5) == pytest.approx(
        args.n_layers * (2 * all_gather(gathered, n, link) + reduce_scatter(gathered, n, link)))
    path = tmp_path / "titan-2024.toml"
    path.write_text('base = "torchtitan"\ncp_repeats_kv = true\n')
    assert resolve_system(str(path)).cp_repeats_kv
    with pytest.raises(PlannerError, match="--system cp_exchange"):
        Training(cp_exchange="ulysses")


def test_transformer_engines_all_to_all_context_parallel_by_hand(tmp_path):
    # Transformer Engine's cp_comm_type "a2a" (AttnFuncWithCPAndQKVOA2A): Q, K and V all-to-all'd from sequence to
    # head shards before the attention and the output back after; in backward the saved output and dO to head
    # shards, then dQ, dK and dV back (TE 1.11 to 2.7); none hidden. A rank's Q (and output) is its s / cp tokens
    # of its tp rank's heads; K and V its KV heads'
    from shardwise.planner.comm import all_to_all, axis_link
    from shardwise.planner.plan import engine_error
    from shardwise.planner.timing import _cp_exposed

    args, cp, tp, seq = preset("llama2-70b"), 4, 2, 8192
    plan = Plan(cp=cp, tp=tp, dp_replicate=2, zero_stage=1, micro_batch=2, activation_checkpoint="none")
    cluster = Cluster(accelerator("gb200"), 16, gpus_per_node=72)
    n, link = axis_link(plan, ("cp",), cluster)
    a2a = dataclasses.replace(_training("megatron-core", seq_len=seq), cp_exchange="a2a")
    q = 2 * seq / cp * args.n_heads / tp * args.head_dim * 2  # bytes of Q (and of the output) a rank hands in
    k = 2 * seq / cp * args.n_kv_heads / tp * args.head_dim * 2  # of K (and of V)
    forward = 2 * all_to_all(q, n, link) + 2 * all_to_all(k, n, link)
    backward = 3 * all_to_all(q, n, link) + 2 * all_to_all(k, n, link)
    assert _cp_exposed(args, a2a, plan, cluster, args.n_layers, 1.0, 2.5) == pytest.approx(
        args.n_layers * (forward + backward))
    for recompute in ("full", "selective"):  # a recomputed forward exchanges again: Megatron-Core's selective
        again = dataclasses.replace(plan, activation_checkpoint=recompute)  # recompute checkpoints TE's attention
        assert _cp_exposed(args, a2a, again, cluster, args.n_layers, 1.0, 2.5) == pytest.approx(
            args.n_layers * (2 * forward + backward)), recompute
    # the ring hides its hops behind a long enough attention; the all-to-all hides nothing
    ring = _training("megatron-core", seq_len=seq)
    assert _cp_exposed(args, ring, plan, cluster, args.n_layers, 1.0, 2.5) == 0.0
    # each cp rank takes whole heads: a tp rank's 4 KV heads do not split 8 ways (TE asserts it), nor 3 ways
    assert engine_error(plan, a2a, args) is None
    for bad in (dataclasses.replace(plan, cp=8, dp_replicate=1), dataclasses.replace(plan, cp=3)):
        error = engine_error(bad, a2a, args)
        assert error is not None and error.field == "parallel.cp" and "a2a" in str(error), bad
        assert engine_error(bad, ring, args) is None or "a2a" not in str(engine_error(bad, ring, args))
    path = tmp_path / "te-a2a.toml"
    path.write_text('base = "megatron-core"\ncp_exchange = "a2a"\n')
    assert resolve_system(str(path)).cp_exchange == "a2a"


@pytest.mark.parametrize("fields", [{"layout": "torch"}, {"layout": "zero", "lora_rank": 16}])
def test_module_by_module_fetch_is_deepspeeds_zero3_only(fields):
    with pytest.raises(PlannerError, match="--system zero3_fetch") as e:
        Training(zero3_fetch="module-sync", **fields)
    assert "\n" not in str(e.value)


def test_module_by_module_fetch_refuses_a_mixture_of_experts():
    training = Training(seq_len=2048, global_batch=64, **SYSTEMS["deepspeed-2021"].training_fields())
    with pytest.raises(PlannerError, match="--system zero3_fetch.*experts"):
        evaluate(preset("mixtral-8x7b"), training, Plan(dp_shard=64, zero_stage=3, activation_checkpoint="full"),
                 Cluster(accelerator("a100-80gb"), 64))


def test_a_system_fetching_module_by_module_says_so(tmp_path, capsys):
    path = tmp_path / "ds-sync.toml"
    path.write_text('base = "deepspeed"\nzero3_fetch = "module-sync"\n')
    argv = ["--model", "llama3-8b", "--gpus", "16", "--seq-len", "2048", "--global-batch", "32", "--top-k", "1",
            "--plan", "dp_shard=16,zero_stage=3"]
    assert run_plan(_ns(*argv, "--system", str(path))) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("system:"))
    assert line.startswith("system: ds-sync - layout zero") and line.endswith(
        ", ZeRO-3 fetched module by module, DeepSpeed gradient buckets of 500,000,000 elements, below ZeRO-3 the "
        "reduction unhidden without overlap_comm; no context parallelism; pipeline schedule 1f1b only; hybrid "
        "sharding at ZeRO-3 only; host offload at ZeRO-3 only; at most ZeRO-1 beside a pipeline")


@pytest.mark.parametrize("text, field", [('selective = "some"\n', "--system selective"),
                                         ('colour = "blue"\n', "--system"),
                                         ('dropout = "yes"\n', "dropout"),
                                         ('zero3_fetch = "eager"\n', "--system zero3_fetch"),
                                         ('swiglu = "compiled"\n', "--system swiglu"),
                                         ('float8 = "mxfp8"\n', "--system float8"),
                                         ('distribute_checkpoints = "yes"\n', "distribute_checkpoints"),
                                         ('base = "torchtitan"\nfloat8 = "te-delayed"\n', "--system float8"),
                                         ('base = "jax"\n', "base"),
                                         # the parallelisms a system runs
                                         ('pp_schedules = ["dualpipe"]\n', "--system pp_schedules"),
                                         ('zero_stages = [1, 4]\n', "--system zero_stages"),
                                         ('zero_stages = []\n', "--system zero_stages"),
                                         ('zero_stages = [3, 1, 1]\n', "--system zero_stages"),
                                         ('hsdp_stages = [true, 3.0]\n', "--system hsdp_stages"),
                                         ('ddp_alone = "no"\n', "ddp_alone"),
                                         ('fsdp_replicate = 1\n', "fsdp_replicate"),
                                         ('fused_projections = "qkv"\n', "fused_projections"),
                                         ('zero3_grads_at_start = "yes"\n', "zero3_grads_at_start"),
                                         ('offload_stages = [2, 2]\n', "--system offload_stages"),
                                         ('pp_schedules = "1f1b"\n', "pp_schedules"),
                                         ('pp_zero_max = 5\n', "--system pp_zero_max"),
                                         ('tensor_parallel = "no"\n', "tensor_parallel")])
def test_bad_system_toml_names_the_field(tmp_path, text, field):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(PlannerError) as e:
        resolve_system(str(path))
    assert field in str(e.value) and "\n" not in str(e.value)


def test_unknown_system_is_refused(capsys):
    assert run_plan(_ns("--model", "llama3-8b", "--gpus", "8", "--system", "jax")) == 2
    assert "--system" in capsys.readouterr().err


def test_collectives_over_nodes_use_every_nic_of_the_node():
    # a ring collective over a group with 8 members in each of 2 nodes (stride 1) moves its inter-node bytes over
    # 8 NICs, up to NVLink's rate; with one member per node (stride 8: data parallelism outside tp 8) over one;
    # point-to-point sends (pipeline, ring attention) and all-to-alls leave through each rank's own NIC
    from shardwise.planner.comm import axis_link, group_link

    h100 = accelerator("h100")
    cluster = Cluster(h100, 16)
    nic, nvlink, eff = h100.inter_node_bw, h100.intra_node_bw, h100.comm_efficiency
    assert group_link(16, 1, cluster, spread=True).bandwidth == pytest.approx(min(8 * nic, nvlink) * eff)
    assert group_link(4, 4, cluster, spread=True).bandwidth == pytest.approx(2 * nic * eff)
    assert group_link(2, 8, cluster, spread=True).bandwidth == pytest.approx(nic * eff)
    assert group_link(16, 1, cluster).bandwidth == pytest.approx(nic * eff)
    assert group_link(16, 1, Cluster(h100, 16, rail_collectives=False), spread=True).bandwidth == pytest.approx(
        nic * eff)
    pipeline = Plan(pp=8, tp=2, micro_batch=1)  # pp groups of stride 2: four members per node, but sends
    assert axis_link(pipeline, ("pp",), cluster)[1].bandwidth == pytest.approx(nic * eff)
    fsdp = Plan(dp_shard=16, zero_stage=3, micro_batch=1)
    assert axis_link(fsdp, fsdp.shard_axes, cluster, spread=True)[1].bandwidth == pytest.approx(
        min(8 * nic, nvlink) * eff)


def test_gradient_sync_every_micro_batch_keeps_only_the_shard():
    # under accumulation, reducing once per step keeps every gradient unsharded (fp32 under layout torch) until the
    # last micro-batch; reducing in every backward does not
    args = preset("llama3-8b")
    plan = Plan(dp_shard=8, zero_stage=3, micro_batch=1, grad_accum=4, activation_checkpoint="full")
    per_step = Training(seq_len=4096, global_batch=32)
    per_micro = dataclasses.replace(per_step, grad_sync="micro-batch")
    cluster = Cluster(accelerator("h100"), 8)
    # in the first block's backward of a micro-batch with more to come
    held_step = moment_memory(args, per_step, plan, 0)["first_block_backward"]["fsdp_buffers"]
    held_micro = moment_memory(args, per_micro, plan, 0)["first_block_backward"]["fsdp_buffers"]
    assert held_step - held_micro == pytest.approx(4 * num_params(args) / plan.tp)
    # and the reduce-scatter runs in each of the 4 micro-batches
    comm_step = evaluate(args, per_step, plan, cluster).time.detail["dp_comm_s"]
    comm_micro = evaluate(args, per_micro, plan, cluster).time.detail["dp_comm_s"]
    assert comm_micro > comm_step


def test_cross_entropy_kernel_keeps_the_logits_in_the_compute_dtype():
    args = preset("llama3-8b")
    plan = Plan(micro_batch=1)
    torch_ce = Training(seq_len=2048, global_batch=8, layout="fsdp-mp", fuse_head=False)
    kernel = dataclasses.replace(torch_ce, ce_kernel=True)
    v, tokens = args.vocab_size, 2048
    # kept: fp32 log-probabilities (4 V) against bf16 logits and a log-sum-exp (2 V + 4) per token
    assert (head_activation_bytes(args, torch_ce, plan) - head_activation_bytes(args, kernel, plan)
            == pytest.approx(tokens * (4 * v - 2 * v - 4)))
    assert logits_bytes(args, kernel, plan) == tokens * v * 2
    assert logits_bytes(args, torch_ce, plan) == tokens * v * 8


def test_torchtitans_compiled_loss_is_sized_as_a_cross_entropy_kernel():
    # torchtitan compiles its loss with the blocks under --compile (components/loss.py build_cross_entropy_loss,
    # since April 2025): cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1)). Compiled here from bf16
    # logits, inductor's code allocates no vocabulary-wide fp32 buffer: its forward keeps the bf16 logits, the
    # targets and per-row statistics, its backward writes one bf16 gradient. Eager, the loss keeps fp32
    # log-probabilities. The planner's difference between the two, and the compiled backward's buffer, are these
    import re

    from torch._inductor.utils import run_and_get_code

    b, s, v = 2, 64, 1000
    args = ModelArgs(name="tiny", dim=64, n_heads=4, n_kv_heads=4, n_layers=1, vocab_size=v, ffn_hidden=128,
                     max_seq_len=s)
    plan = Plan(micro_batch=b)
    eager = _training("torchtitan", seq_len=s)
    compiled = dataclasses.replace(eager, compile=True)
    assert compiled.loss_kernel and not eager.loss_kernel
    assert not dataclasses.replace(compiled, compile_loss=False).loss_kernel  # torchtitan's code of December 2024
    from shardwise.planner.cli import system_summary  # what `shardwise plan --system torchtitan --compile` says

    assert system_summary(compiled).endswith("compiled blocks (elementwise operators fused), the loss one kernel "
                                             "over the logits, DDP buckets a copy of the gradients; ZeRO-0, 2, 3 "
                                             "over data-parallel ranks; DDP only alone")

    def loss_fn(pred, labels):
        return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))

    def kept_bytes(fn):
        pred = torch.randn(b, s, v, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, v, (b, s))
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = fn(pred, labels)
        return sum(storages.values()), loss

    torch.manual_seed(0)
    eager_kept, _ = kept_bytes(loss_fn)
    compiled_kept, loss = kept_bytes(torch.compile(loss_fn))
    assert (eager_kept - compiled_kept == pytest.approx(
        head_activation_bytes(args, eager, plan) - head_activation_bytes(args, compiled, plan), rel=1e-2))
    # the generated code, forward then backward: per-row buffers only, then one bf16 gradient of the logits
    pred = torch.randn(b, s, v, dtype=torch.bfloat16, requires_grad=True)
    _, (forward, backward) = run_and_get_code(
        lambda: torch.compile(loss_fn)(pred, torch.randint(0, v, (b, s))).backward())
    allocation = re.compile(r"empty_strided_cpu\(\(([\d, ]*)\), \([\d, ]*\), torch\.(\w+)\)")

    def wide(code):
        sizes = [(tuple(int(x) for x in shape.split(",") if x.strip()), dtype)
                 for shape, dtype in allocation.findall(code)]
        assert sizes
        return [(shape, dtype) for shape, dtype in sizes if v in shape]

    assert wide(forward) == []
    assert wide(backward) == [((b * s, v), "bfloat16")]
    assert logits_bytes(args, compiled, plan) == b * s * v * 2
    assert logits_bytes(args, eager, plan) == b * s * v * 8


def test_llm_foundry_70b_with_accumulation_fits_as_it_ran():
    # llm-foundry's MPT-70B on 64 H100s, micro-batch 8, 4 accumulation steps, FULL_SHARD, activation checkpointing
    # (scripts/train/benchmarking/README.md, "H100 80GB BF16"): it ran. Composer reduce-scatters in every
    # micro-batch; sized as if FSDP kept 70B unsharded gradients across micro-batches it would not fit
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import planner_published as published

    run = next(r for r in published.foundry_runs() if r.name == "foundry h100 70b s=2048 n=64 mb=8")
    ev, fits = published.given_plan(run)
    assert fits and ev.memory["total"] < 80 * GiB
    step_sync = dataclasses.replace(published.training_of(run), grad_sync="step")
    assert not evaluate(run.model, step_sync, ev.plan, published.cluster_of(run)).fits


@pytest.mark.parametrize("t, sp", [(1, False), (8, False), (8, True)])
def test_gelu_block_reproduces_korthikantis_activation_formula(t, sp):
    # Korthikanti et al. 2022, table 2 (GPT block: GELU MLP of 4h, Megatron's unfused attention and dropout, 16-bit
    # activations), bytes per layer: s b h (10 + 24/t + 5 a s / (h t)) with tensor parallelism, s b h (34/t +
    # 5 a s / (h t)) with sequence parallelism too; our terms add only fp32 statistics (norm rstd, attention lse)
    gpt3 = ModelArgs(name="gpt3-175b", dim=12288, n_heads=96, n_kv_heads=96, n_layers=96, vocab_size=51200,
                     ffn_hidden=4 * 12288, mlp="gelu", max_seq_len=2048, tie_embeddings=True)
    s, b, h, a = 2048, 1, 12288, 96
    training = _training("megatron-lm-2021", seq_len=s)
    plan = Plan(tp=t, micro_batch=b, sequence_parallel=sp)
    expected = s * b * h * ((34 / t if sp else 10 + 24 / t) + 5 * a * s / (h * t))
    assert layer_activation_bytes(gpt3, training, plan) == pytest.approx(expected, rel=2e-3)


class _MegatronSwiGLU(torch.autograd.Function):
    """The save set of Megatron-Core's SwiGLUFunction (megatron/core/fusions/fused_bias_swiglu.py): the fc1 output
    (w1 and w3 side by side) only; SiLU is recomputed in backward."""

    @staticmethod
    def forward(ctx, y):
        ctx.save_for_backward(y)
        y1, y2 = torch.chunk(y, 2, -1)
        return torch.nn.functional.silu(y1) * y2

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        y1, y2 = torch.chunk(y, 2, -1)
        sig = torch.sigmoid(y1)
        return torch.cat((g * sig * (1 + y1 * (1 - sig)) * y2, g * y1 * sig), -1)


def _saved_bytes(fn, *inputs) -> int:
    """Bytes autograd keeps for backward while fn runs (distinct storages, parameters left out)."""
    seen: dict[int, int] = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(seen.values())


def test_megatron_cores_fused_swiglu_keeps_its_input_only():
    # what the two SwiGLU forms keep, measured: PyTorch operators against Megatron-Core's function; the planner's
    # difference between its systems is SiLU's output, f bf16 elements per token
    tokens, d, f = 64, 32, 96
    fc1 = torch.nn.Linear(d, 2 * f, bias=False, dtype=torch.bfloat16)
    fc2 = torch.nn.Linear(f, d, bias=False, dtype=torch.bfloat16)
    x = torch.randn(tokens, d, dtype=torch.bfloat16, requires_grad=True)

    def eager(x):
        y1, y2 = torch.chunk(fc1(x), 2, -1)
        return fc2(torch.nn.functional.silu(y1) * y2)

    def fused(x):
        return fc2(_MegatronSwiGLU.apply(fc1(x)))

    measured = _saved_bytes(eager, x) - _saved_bytes(fused, x)
    args = preset("llama3-8b")
    eager_tr, fused_tr = _training("torchtitan"), _training("megatron-core")
    assert (eager_tr.swiglu, fused_tr.swiglu) == ("eager", "fused")
    plan = Plan()
    per_token = [sum(term_bytes(t, args, tr, plan) for t in block_terms(args, tr, "none", 0))
                 for tr in (eager_tr, dataclasses.replace(eager_tr, swiglu="fused"))]
    assert measured == tokens * f * 2
    assert per_token[0] - per_token[1] == args.ffn_hidden * 2


def test_llama3_405b_layer_under_megatron_core_by_hand():
    # tp 8 with sequence parallelism, bf16, per token: the norms' inputs and outputs, q and the attention output
    # (d / t each), k and v (one KV head per rank), the fused SwiGLU's input and w2's input (3f / t), fp32 rstd
    # of both norms and a log-sum-exp per head
    args = preset("llama3-405b")
    d, kv, f, a, t, s = args.dim, args.n_kv_heads * args.head_dim, args.ffn_hidden, args.n_heads, 8, 8192
    plan = Plan(tp=t, micro_batch=1, sequence_parallel=True)
    expected = s * (2 * (6 * d + 3 * f + 2 * kv) / t + 4 * (2 + a) / t)
    assert layer_activation_bytes(args, _training("megatron-core", seq_len=s), plan) == pytest.approx(expected,
                                                                                                    rel=1e-12)
    assert expected / (s * d / t) == pytest.approx(31.78, abs=0.01)


def test_the_engine_refuses_a_gelu_model(tmp_path):
    from shardwise.config import ConfigError, load_config

    path = tmp_path / "job.toml"
    path.write_text('[model]\nmlp = "gelu"\n')
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "model.mlp" in str(e.value)


def test_fsdp_mixed_precision_needs_fsdp():
    # torchtitan applies FSDP2's mixed-precision policy only where FSDP shards; its DDP runs under autocast:
    # a ZeRO-1 plan of the torchtitan system is sized as the layout 'torch' (fp32 stream, autocast copies)
    args = preset("llama3-8b")
    titan = _training("torchtitan")
    autocast = dataclasses.replace(titan, layout="torch")
    cluster = Cluster(accelerator("h100"), 8)
    ddp = Plan(dp_replicate=8, zero_stage=1, micro_batch=1, activation_checkpoint="full")
    assert evaluate(args, titan, ddp, cluster).memory == evaluate(args, autocast, ddp, cluster).memory
    fsdp = Plan(dp_shard=8, zero_stage=3, micro_batch=1, activation_checkpoint="full")
    assert evaluate(args, titan, fsdp, cluster).memory != evaluate(args, autocast, fsdp, cluster).memory


@pytest.mark.parametrize("name, text", [("titan.toml", 'name = "shardwise"\n'),
                                        ("shardwise.toml", 'grad_sync = "micro-batch"\n')])
def test_a_system_toml_cannot_pass_for_shardwise(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(PlannerError, match="--system"):
        resolve_system(str(path))


def test_write_config_refuses_any_field_shardwise_does_not_run(tmp_path, capsys):
    path = tmp_path / "sync-every-micro-batch.toml"
    path.write_text('grad_sync = "micro-batch"\n')
    argv = ["--model", "llama3-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "16", "--top-k", "1",
            "--system", str(path), "--write-config", str(tmp_path / "job.toml")]
    assert run_plan(_ns(*argv)) == 2
    assert "--system" in capsys.readouterr().err
    assert not (tmp_path / "job.toml").exists()


def test_layout_flag_alone_does_not_fuse_the_head_of_another_layout():
    ns = _ns("--model", "llama3-8b", "--gpus", "8", "--layout", "zero")
    from shardwise.planner.cli import build_inputs

    training = build_inputs(ns)[1]
    assert training.layout == "zero" and not training.fuses_head
    assert not build_inputs(_ns("--model", "llama3-8b", "--gpus", "8", "--system", "megatron-lm-2021",
                                "--no-dropout"))[1].dropout


def _published_module():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import planner_published

    return planner_published


def test_megatron_core_scaling_table_from_70b_up():
    # Megatron-LM README's scaling table (H100, GPT 70B to 462B on TP 8 and PP 2-16): per-GPU throughput within
    # 10% of the published figure (|predicted / published - 1| of throughput, the benchmark's and the issue's
    # measure; 70B on 768 GPUs is the closest, at 0.905), described as megatron-core (the smaller rows are further
    # off: docs/planner.md)
    published = _published_module()
    for run in published.mcore_runs():
        if run.model.dim >= 8192:
            ev, fits = published.given_plan(run)
            assert fits and abs(run.published_step() / ev.time.step_time_s - 1) <= 0.10, run.name


def test_narayanan_gpt3_zero3_runs_as_deepspeed_2021_fetched_them():
    # Narayanan et al. 2021, table 2: GPT-3 175B under DeepSpeed's ZeRO-3 on 384, 768 and 1,536 A100s (144, 88
    # and 44 TFLOP/s per GPU). Described as DeepSpeed v0.3.13 fetched weights (module by module, synchronised,
    # gathered again for the recomputed forward and for backward beyond the reuse distance) the predicted over the
    # published throughput is 0.85 to 1.02 (the more GPUs, the more pessimistic: NCCL's ring latency over 1,536
    # ranks); as FSDP prefetches, all three are more than 24% optimistic (1.249 to 1.268).
    published = _published_module()
    runs = [run for run in published.RUNS if run.name.startswith("N21 T2 ZeRO-3 gpt3-175b")]
    assert len(runs) == 3 and all(run.system == "deepspeed-2021" for run in runs)
    for run in runs:
        ev, fits = published.given_plan(run)
        assert fits and 0.84 <= run.published_step() / ev.time.step_time_s <= 1.05, run.name
        prefetched = evaluate(run.model, dataclasses.replace(published.training_of(run), zero3_fetch="prefetch"),
                              ev.plan, published.cluster_of(run))
        assert run.published_step() / prefetched.time.step_time_s > 1.24, run.name


def test_narayanan_530b_zero3_fits_on_640_gpus_and_not_on_560():
    # Narayanan et al. 2021, table 2: the 530B under DeepSpeed's ZeRO-3 at micro-batch 4 ran on 640 A100s and
    # did not fit on 560. Sized as DeepSpeed's first ZeRO-3 gathers (two linear modules, no root held) both agree;
    # sized as FSDP's (two blocks and the root) the 640-GPU run was given 94.8 GiB
    published = _published_module()
    runs = {run.gpus: run for run in published.RUNS if run.name.startswith("N21 T2 ZeRO-3 gpt-530b")}
    assert published.given_plan(runs[640])[1] and not published.given_plan(runs[560])[1]
    ev = published.given_plan(runs[640])[0]
    as_fsdp = evaluate(runs[640].model, dataclasses.replace(published.training_of(runs[640]), zero3_fetch="prefetch"),
                       ev.plan, published.cluster_of(runs[640]))
    assert not as_fsdp.fits


def test_llm_foundry_a100_runs_median_error():
    # llm-foundry's A100 80GB table (61 runs, FlashAttention-1 as its benchmark installed it): the median of
    # |predicted / published throughput - 1| within the 6% the planner is held to, and every run that ran fits
    import statistics

    published = _published_module()
    errors = []
    for run in published.foundry_runs():
        if run.gpu == "a100-80gb":
            ev, fits = published.given_plan(run)
            assert fits, run.name
            errors.append(abs(run.published_step() / ev.time.step_time_s - 1))
    assert len(errors) == 61 and statistics.median(errors) <= 0.06


def test_llm_foundrys_fp8_table_held_out_with_torchaos_recipe_in_tes_place():
    # llm-foundry's "H100 80GB FP8" table (7 runs: MPT 1B and 3B on 8 H100s, Transformer Engine's linears under
    # FSDP1) was evaluated first as the planner stood (docs/heldout-2026-12-06/): torchao's float8 recipe stands in
    # for TE's, which the planner describes only inside Megatron-Core. Every run fits, the median error is 4.2%
    # (0.90 to 1.03), and each model's rows rank as published
    import statistics

    published = _published_module()
    rows = [run for run in published.foundry_runs() if run.precision == "fp8"]
    assert len(rows) == 7 and all(published.training_of(run).float8 == "torchao" for run in rows)
    errors, by_model = [], {}
    for run in rows:
        ev, fits = published.given_plan(run)
        assert fits, run.name
        ratio = run.published_step() / ev.time.step_time_s
        errors.append(abs(ratio - 1))
        tokens = run.batch * run.seq / run.gpus  # a GPU's tokens a step
        by_model.setdefault(run.model.name, []).append((tokens / ev.time.step_time_s,
                                                       tokens / run.published_step(), run.name))
    assert statistics.median(errors) <= 0.05 and max(errors) < 0.11
    for model, points in by_model.items():  # tokens/s per GPU: the same order predicted as published
        assert [p[2] for p in sorted(points)] == [p[2] for p in sorted(points, key=lambda p: p[1])], model


def test_flash_attention_1_on_hopper_prices_llm_foundrys_long_sequence_runs_within_17_percent():
    # llm-foundry's H100 runs at 16K-65K tokens, where attention is most of the work. They ran llm-foundry's Triton
    # kernel (its --attn_impl default), priced as FlashAttention-1, whose Hopper share is derived from
    # FlashAttention-2's own A100 -> H100 loss in training's shape (hardware.KERNEL_EFFICIENCY). Every one is
    # pessimistic, by 5% to 16% (at the 0.45 assumed before the derivation, 1.7 to 2.1 times optimistic; with
    # FlashAttention-2's Hopper share taken from FlashAttention-3's abstract, 0.35, within 10% either way)
    published = _published_module()
    ratios = {}
    for run in published.foundry_runs():
        if run.gpu == "h100" and run.seq >= 16384 and run.precision == "bf16":
            ev, fits = published.given_plan(run)
            assert fits, run.name
            ratios[run.name] = run.published_step() / ev.time.step_time_s
    assert len(ratios) == 12
    assert all(0.83 <= r < 1.0 for r in ratios.values()), ratios


# ---------------------------------------------------------------------------------------------------
# Float8, torch.compile and FSDP2 in a pipeline: torchtitan's published benchmark, every table


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("m, k, n", [(16384, 4096, 14336), (16384, 14336, 4096), (8192, 4096, 1024),
                                     (64, 256, 128)])
def test_float8_casts_are_torchaos_own_roofline(m, k, n, fused):
    # torchao's float8 roofline (torchao.testing.training.roofline_utils, the library the recipe names) prices
    # tensorwise scaling kernel by kernel, with its fusion modelling for a compiled block (the amax of the input
    # and of the output's gradient fused into the kernel that made them): the planner's casts are the same
    # kernels, each at least the measured launch time (the last shape is all launch time)
    sympy = pytest.importorskip("sympy")
    roofline = pytest.importorskip("torchao.testing.training.roofline_utils")
    from shardwise.planner.timing import float8_cast_seconds

    specs = roofline.get_specs("NVIDIA H100")
    bandwidth = specs["peak_mem_bw_bytes_sec"] * specs["pct_achievable_mem_bw"]
    theirs = roofline.get_float8_mem_sympy(m, k, n, "tensorwise", None, fused, gpu_name="NVIDIA H100")
    ours = sum(float8_cast_seconds(m, k, n, bandwidth, fused=fused))
    assert ours == pytest.approx(float(sympy.sympify(theirs)), rel=1e-12)


def test_float8_runs_the_linears_at_the_fp8_peak_and_attention_and_the_head_in_bf16():
    # torchtitan converts every linear but the output head (module_filter_fn), and attention is SDPA in bf16
    from shardwise.planner.timing import _head_times, float8_cast_seconds, layer_times, linear_times

    args, acc = preset("llama3-8b"), accelerator("h100")
    plan = Plan(dp_shard=8, zero_stage=3, micro_batch=2)
    bf16 = _training("torchtitan", seq_len=8192, global_batch=16)
    fp8 = dataclasses.replace(bf16, precision="fp8")
    assert (fp8.compute_dtype, fp8.linear_dtype) == ("bf16", "fp8")
    for key in ("attention", "attention_bwd", "elementwise", "elementwise_bwd"):
        assert layer_times(args, fp8, plan, acc)[key] == layer_times(args, bf16, plan, acc)[key]
    assert _head_times(args, fp8, plan, acc) == _head_times(args, bf16, plan, acc)
    tokens = 2 * 8192
    bandwidth = acc.mem_bandwidth * acc.bandwidth_efficiency
    casts = [float8_cast_seconds(tokens, k, n, bandwidth, fused=False) for _, k, n in
             [(name, i, o) for name, (i, o) in args_shapes(args).items()]]
    fwd8, bwd8, w8 = linear_times(args, fp8, plan, acc, tokens)
    fwd, bwd, w = linear_times(args, bf16, plan, acc, tokens)
    # twice the peak halves these GEMMs (all compute-bound but the thin key and value projections, near the
    # roofline's memory bound in bf16: 1e-4 of the sum); the casts come on top
    assert fwd8 - sum(c[0] for c in casts) == pytest.approx(fwd / 2, rel=1e-4)
    assert bwd8 - sum(c[1] for c in casts) == pytest.approx(bwd / 2, rel=1e-4)
    assert w8 == pytest.approx(w / 2, rel=1e-4)
    # MFU stays model FLOPs over the bf16 peak: a float8 step reads as faster, not as a different yardstick
    cluster = Cluster(accelerator("h100"), 8)
    e8, e16 = evaluate(args, fp8, plan, cluster), evaluate(args, bf16, plan, cluster)
    assert e8.time.mfu / e16.time.mfu == pytest.approx(e16.time.step_time_s / e8.time.step_time_s)


def args_shapes(args):
    from shardwise.model_args import projection_shapes

    return projection_shapes(args)


def test_torchtitan_float8_and_compile_speedups_match_its_benchmark():
    # tables 1 and 3 (Llama 3.1 8B, FSDP on 8 and 128 H100s): eager -> torch.compile -> + Float8, 5,762 -> 6,667 ->
    # 8,532 and 5,605 -> 6,514 -> 8,380 tokens/s per GPU. The planner's steps from one to the next (elementwise
    # fused; the linears in float8 with torchao's casts) within 3% of those measured, and each row within 11% (the
    # 128-GPU rows are the 10-11%: what data parallelism loses at scale, "Known gaps", is not priced)
    published = _published_module()
    rows = {run.name: run for run in published.torchtitan_runs() if " s=8K" in run.name and "70B" not in run.name
            and "405B" not in run.name}
    assert len(rows) == 6
    predicted = {}
    for name, run in rows.items():
        ev, fits = published.given_plan(run)
        assert fits, name
        assert run.published_step() / ev.time.step_time_s == pytest.approx(1.0, abs=0.11), name
        predicted[name] = ev.time.tokens_per_s
    for n in (8, 128):
        names = [f"torchtitan 8B FSDP{how} n={n} s=8K" for how in ("", " compile", " compile+Float8")]
        for before, after in zip(names, names[1:]):
            measured = rows[before].published_step() / rows[after].published_step()
            assert predicted[after] / predicted[before] == pytest.approx(measured, rel=0.03), after


def test_torchtitans_h200_runs_of_2025_fit_at_their_measured_memory():
    # Trainy's baseline in torchtitan's benchmarks (June 2025): Llama 3.1 8B, FSDP over 32 and 64 H200s, blocks and
    # loss compiled, Float8, op-level selective checkpointing, local batch 2 x 8192: 47.96 and 46.97 GiB measured.
    # Sized with the loss eager on fp32 logits, as the planner sized every torchtitan run before, they came out at
    # 66 and 65 GiB. Their throughput is 11-13% below the planner's (torchtitan's rows, "Known gaps")
    published = _published_module()
    rows = published.trainy_runs()
    assert [run.gpus for run in rows] == [32, 64]
    for run in rows:
        ev, fits = published.given_plan(run)
        assert fits
        # (torchtitan logs torch's reserved memory: docs/planner.md, "Reserved memory")
        assert published.published_memory(ev, run) / GiB / run.mem_gib == pytest.approx(1.0, abs=0.05), run.name
        assert run.published_step() / ev.time.step_time_s == pytest.approx(1.0, abs=0.15), run.name
        eager_loss = dataclasses.replace(published.training_of(run), compile_loss=False)
        assert published.published_memory(evaluate(run.model, eager_loss, ev.plan, published.cluster_of(run)),
                                          run, eager_loss) > 1.3 * run.mem_gib * GiB


def test_torchaos_float8_runs_fit_as_torchtitans_loss_of_their_date_kept_it():
    # torchao's float8 benchmarks ran torchtitan's Llama 3.1 8B on 8 GPUs, batch 1 x 8192, blocks compiled: on H100s
    # in March 2025, before torchtitan compiled its loss too (47.65 and 47.77 GiB), and on MI300Xs in August 2025,
    # after (39.09 and 39.07 GiB). Each comes within 10% as its code ran, and out by more than 10% the other way
    published = _published_module()
    rows = published.torchao_runs()
    assert [(run.gpu, run.compile_loss) for run in rows] == [("h100", False)] * 2 + [("mi300x", True)] * 2
    # the H100s are torchtitan's 96GB, 500 W ones: the script's PR (pytorch/ao 1802) logs "47.79GiB(50.30%)", a
    # 95 GiB device, where an 80 GB H100 shows 79.1
    for run in rows[:2]:
        assert (run.gpu_memory_gib, run.mem_bandwidth_tbs, run.peak_tflops) == (
            96, 2.4, published.TORCHTITAN_H100_PEAK), run.name
        # against the published tokens/s: within 10% on that H100, more than 15% fast on the catalogue's SXM
        ratio = run.published_step() / published.given_plan(run)[0].time.step_time_s
        sxm = dataclasses.replace(run, gpu_memory_gib=None, mem_bandwidth_tbs=None, peak_tflops=None)
        assert abs(ratio - 1) < 0.1, run.name
        assert sxm.published_step() / published.given_plan(sxm)[0].time.step_time_s > 1.15, run.name
    for run in rows:
        ev, fits = published.given_plan(run)
        assert fits
        assert published.published_memory(ev, run) / GiB / run.mem_gib == pytest.approx(1.0, abs=0.1), run.name
        other = dataclasses.replace(published.training_of(run), compile_loss=not run.compile_loss)
        other_gib = published.published_memory(evaluate(run.model, other, ev.plan, published.cluster_of(run)),
                                                run, other) / GiB
        assert abs(other_gib / run.mem_gib - 1) > 0.1, run.name


def test_fsdp2_packs_gradients_on_the_compute_stream_and_fsdp1_joins_them():
    # torch's FSDP2 runs the reduce-scatter's copy-in (chunk_cat of the unsharded gradients into the flat buffer of
    # the reduce dtype) in the post-backward hook on the current stream, before the reduce-scatter stream waits on
    # it (_fsdp_collectives.foreach_reduce; PR 129721): on a GPU it is on the critical path, not hidden with the
    # collective. Read here in the installed torch's source, then priced on the catalogue H100 (comm_overlap 1):
    # ZeRO-2 under torchtitan's FSDP2, gradients reduced every micro-batch, each micro-batch's exposed copies are
    # the gathered bf16 weights split out (read and written, 2 + 2 bytes a parameter) and the gradients packed
    # from bf16 into fp32 (2 + 4). FSDP1's weights are views of its flat parameter: backward joins their gradients
    # into the flat one (autograd's SplitWithSizesBackward, a cat in bf16: 2 + 2 on the compute stream), and the
    # cast to fp32 for the reduction runs on its post-backward stream (hidden on a GPU, not on a CPU)
    import inspect

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    source = inspect.getsource(_fsdp_collectives.foreach_reduce)
    assert source.index("foreach_reduce_scatter_copy_in(") < source.index("reduce_scatter_stream.wait_stream(")
    assert source.index("reduce_scatter_stream.wait_stream(") < source.index("with device_handle.stream(reduce_scat")
    from shardwise.planner.timing import sharding_copies

    args, acc = preset("llama3-8b"), accelerator("h100")
    bandwidth = acc.mem_bandwidth * acc.bandwidth_efficiency
    plan = Plan(dp_shard=8, zero_stage=2, micro_batch=1, grad_accum=4)
    fsdp2 = _training("torchtitan", global_batch=32, seq_len=8192)
    assert fsdp2.reduces_every_micro_batch(plan.pp)
    per_micro_batch = num_params(args) * ((2 + 2) + (2 + 4))
    assert sharding_copies(args, fsdp2, plan, acc) == pytest.approx(4 * per_micro_batch / bandwidth, rel=1e-9)
    bf16 = dataclasses.replace(fsdp2, reduce_dtype="bf16")  # packed from bf16 into bf16: 2 + 2
    assert sharding_copies(args, bf16, plan, acc) == pytest.approx(4 * num_params(args) * 8 / bandwidth, rel=1e-9)
    fsdp1 = dataclasses.replace(fsdp2, flat_params=True)
    joined = 4 * num_params(args) * (2 + 2)
    for training in (fsdp1, dataclasses.replace(bf16, flat_params=True)):
        assert sharding_copies(args, training, plan, acc) == pytest.approx(joined / bandwidth, rel=1e-9)
    cpu = dataclasses.replace(acc, comm_overlap=0.0)  # nothing hides: the cast of bf16 gradients to fp32 shows
    cast = 4 * num_params(args) * (2 + 4)
    assert sharding_copies(args, fsdp1, plan, cpu) == pytest.approx((joined + cast) / bandwidth, rel=1e-9)
    assert SYSTEMS["llm-foundry"].flat_params and not SYSTEMS["torchtitan"].flat_params
    with pytest.raises(PlannerError, match="flat_params"):
        Training(seq_len=4096, global_batch=8, flat_params=True)  # layout torch: FSDP2


def _composer_adamw(params, grads, exp_avgs, exp_avg_sqs, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, step=3):
    # composer/optim/decoupled_weight_decay.py, DecoupledAdamW.adamw at v0.16.0 (weight_decay 0, no amsgrad), as is
    for i, param in enumerate(params):
        grad, exp_avg, exp_avg_sq = grads[i], exp_avgs[i], exp_avg_sqs[i]
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
        step_size = lr / bias_correction1
        param.addcdiv_(exp_avg, denom, value=-step_size)


def _composer_sgdw(params, d_p_list, momentum_buffer_list, momentum, lr=1e-2):
    # DecoupledSGDW.sgdw at v0.16.0 (dampening 0, no nesterov, weight_decay 0), after the first step
    for i, param in enumerate(params):
        d_p = d_p_list[i]
        if momentum != 0:
            buf = momentum_buffer_list[i]
            buf.mul_(momentum).add_(d_p, alpha=1)
            d_p = buf
        param.add_(d_p, alpha=-lr)


def _fsdp1_clip(grads, max_norm=1e-12):
    # torch/distributed/fsdp/fully_sharded_data_parallel.py, clip_grad_norm_ (torch 2.1) on one rank: the local
    # norm of every gradient, then each scaled in place by the clamped coefficient (a step that learns clips here)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2.0, dtype=torch.float32)
                                                 for g in grads]), 2.0)
    clip_coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(clip_coef)  # the source's g.detach() is a view, no traffic (the counter would charge it a read)


@pytest.mark.parametrize("optimizer", ["adamw", "momentum", "sgd"])
def test_composers_optimizer_is_a_pass_per_operation(optimizer):
    # llm-foundry's pretraining yamls run Composer's decoupled_adamw (a Python loop over the parameters, each
    # operation its own pass) after FSDP1's clip_grad_norm_: the planner's per-op bytes are those the step's
    # operators read and write, counted here by the dispatcher on Composer's code as it stands at v0.16.0, against
    # the fused one-pass step every other non-torch system keeps
    from shardwise.planner.opcount import OpCounter
    from shardwise.planner.timing import optimizer_time, per_op_optimizer_bytes

    foundry = _training("llm-foundry", optimizer=optimizer)
    assert foundry.optimizer_passes == "per-op" and _training("torchtitan").optimizer_passes == "fused"
    n = 1 << 16
    params, grads, first, second = ([torch.randn(n) for _ in range(3)] for _ in range(4))
    with OpCounter() as counted:
        _fsdp1_clip(grads)
        if optimizer == "adamw":
            _composer_adamw(params, grads, first, second)
        else:
            _composer_sgdw(params, grads, first, momentum=0.9 if optimizer == "momentum" else 0.0)
    assert counted.bytes / (3 * n) == pytest.approx(per_op_optimizer_bytes(foundry), rel=1e-3)
    plan, acc = Plan(dp_shard=8, zero_stage=3), accelerator("h100")
    fused = dataclasses.replace(foundry, optimizer_passes="fused")
    ratio = optimizer_time(preset("llama3-8b"), foundry, plan, acc) / optimizer_time(preset("llama3-8b"), fused,
                                                                                    plan, acc)
    one_pass = {"adamw": 4 + 4 + 4 + 2 * 8, "momentum": 4 + 4 + 4 + 2 * 4, "sgd": 4 + 4 + 4}[optimizer]
    assert ratio == pytest.approx(per_op_optimizer_bytes(foundry) / one_pass, rel=1e-6)
    with pytest.raises(PlannerError, match="optimizer_passes"):
        _training("llm-foundry", optimizer="adamw8bit")
    for layout in ("torch", "zero", "megatron"):  # FSDP's fp32 shards stepped pass by pass: layout fsdp-mp only
        with pytest.raises(PlannerError, match="optimizer_passes"):
            Training(seq_len=4096, global_batch=8, layout=layout, optimizer_passes="per-op")
    # on the command line another library's optimizer is its own step: fused, and the system's name says so
    ns = argparse.Namespace(system="llm-foundry", layout=None, attention=None, dropout=None, compile=None,
                            optimizer="adamw8bit")
    assert system_of(ns).optimizer_passes == "fused" and "optimizer_passes fused" in system_of(ns).name
    assert system_of(argparse.Namespace(**{**vars(ns), "optimizer": optimizer})).optimizer_passes == "per-op"
    for layout in ("torch", "zero", "megatron", "fsdp-mp"):  # --layout and --optimizer both leave it
        for choice in (optimizer, "adamw8bit"):
            system = system_of(argparse.Namespace(**{**vars(ns), "layout": layout, "optimizer": choice}))
            passes = "per-op" if layout == "fsdp-mp" and choice == optimizer else "fused"
            assert system.optimizer_passes == passes, (layout, choice)
            Training(seq_len=4096, global_batch=8, optimizer=choice, **system.training_fields())


def test_torch_foreach_adamw_is_a_pass_per_operation_as_torchtitans_2024_rows_ran_it():
    # torchtitan's AdamW was torch's foreach implementation until its PR 881 (2025-02-24) made fused the default:
    # its December 2024 benchmark rows are priced per-op, its later rows (2025 async TP, Trainy's) fused. torch's
    # own foreach AdamW with weight decay and foreach clipping, counted on the real step here, moves the bytes the
    # planner prices for the layout's fp32 shards
    from shardwise.planner.opcount import OpCounter
    from shardwise.planner.timing import per_op_optimizer_bytes

    n = 1 << 16
    params = [torch.nn.Parameter(torch.randn(n)) for _ in range(3)]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=True)
    for step in range(2):
        for p in params:
            p.grad = torch.randn(n)
        with OpCounter() as counted:
            torch.nn.utils.clip_grad_norm_(params, 1e-12, foreach=True)
            opt.step()  # the first step makes the moments; the second is the steady state counted
    titan = _training("torchtitan", optimizer_passes="per-op")
    assert counted.bytes / (3 * n) == pytest.approx(per_op_optimizer_bytes(titan), rel=1e-3)
    published = _published_module()
    passes = {}
    for run in published.RUNS:
        if run.system == "torchtitan":
            passes.setdefault(run.source, set()).add(published.training_of(run).optimizer_passes)
    assert passes[published.TORCHTITAN] == {"per-op"}
    for source in (published.TORCHTITAN_2025, published.TRAINY, published.OLMO_CORE, published.TORCHAO):
        assert passes[source] == {"fused"}, source


def test_olmo_cores_fsdp2_rows_held_out():
    # OLMo-core's README (e27ba74, November 2024): OLMo-1124 1B, 7B and 13B and a Llama 3 8B on H100s, FSDP2, blocks
    # and loss compiled, no recompute, BF16 and torchao's float8, tokens/s per device. Evaluated held out as
    # `--system torchtitan` on the launcher's 8 GPUs: every row fits; 1B, 7B and 8B within 6% of the published
    # throughput, float8's gain over BF16 within 5% of the published one; the 13B (one sequence a micro-batch, its
    # FSDP traffic the largest share of its compute) optimistic, the gap docs/planner.md names
    published = _published_module()
    rows = published.olmo_core_runs()
    assert len(rows) == 8 and {run.gpus for run in rows} == {8}
    step = {}
    for run in rows:
        ev, fits = published.given_plan(run)
        assert fits and ev.memory["total"] < 80 * GiB, run.name
        step[run.name] = ev.time.step_time_s
        ratio = run.published_step() / ev.time.step_time_s
        if "13B" in run.name:
            assert 1.05 < ratio < 1.3, run.name
        else:
            assert ratio == pytest.approx(1.0, abs=0.06), run.name
    for bf16, fp8 in zip(rows[::2], rows[1::2]):
        if "13B" not in bf16.name:
            measured = bf16.published_step() / fp8.published_step()
            assert step[bf16.name] / step[fp8.name] == pytest.approx(measured, rel=0.05), fp8.name


def test_compile_is_priced_fused_and_written_as_the_engines_train_compile(tmp_path, capsys):
    from shardwise.config import load_config

    argv = ["--model", "llama3-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "16", "--top-k", "1"]
    assert run_plan(_ns(*argv, "--compile", "--write-config", str(tmp_path / "job.toml"))) == 0
    out = capsys.readouterr().out
    assert "system: shardwise (compile)" in out and "compiled blocks" in out
    assert load_config(tmp_path / "job.toml").train.compile
    assert run_plan(_ns(*argv, "--write-config", str(tmp_path / "eager.toml"))) == 0
    assert not load_config(tmp_path / "eager.toml").train.compile
    # fused elementwise work: the compiled step is the faster
    args, cluster = preset("llama3-8b"), Cluster(accelerator("h100"), 8)
    plan = Plan(dp_shard=8, zero_stage=3, micro_batch=2)
    eager = _training("shardwise", seq_len=8192, global_batch=16)
    compiled = dataclasses.replace(eager, compile=True)
    step = {t: evaluate(args, t, plan, cluster).time.step_time_s for t in (eager, compiled)}
    assert step[compiled] < step[eager]
    assert dataclasses.replace(compiled, elementwise="fused") != compiled  # compile, not the field, decides


def test_compile_leaves_out_zero_bubble_as_the_engine_does():
    from shardwise.planner.plan import engine_error

    args = preset("llama3-8b")
    plan = Plan(pp=2, dp_shard=4, zero_stage=2, pp_schedule="zero-bubble", micro_batch=1, grad_accum=4)
    compiled = Training(seq_len=4096, global_batch=16, compile=True)
    assert engine_error(plan, compiled, args).field == "train.compile"
    assert engine_error(plan, dataclasses.replace(compiled, compile=False), args) is None


@pytest.mark.parametrize("zero", [2, 3])
def test_fsdp2_in_a_pipeline_gathers_as_the_simulator_counts(zero):
    # torch.distributed.pipelining keeps a stage's FSDP2 units unsharded after every backward but the step's last:
    # ZeRO-2 (no reshard after forward either) gathers each unit once per step whatever the micro-batches, ZeRO-3
    # again for every micro-batch. The simulator counts the engine's all-gathers; the planner's gather time follows
    from shardwise.simulate import config_from_plan, simulate_rank

    calls, comm = {}, {}
    for m in (4, 8):
        cfg = config_from_plan("llama3-8b", f"pp=2,dp_shard=8,zero_stage={zero},grad_accum={m},pp_schedule=1f1b",
                               16, seq_len=1024, micro_batch=m, precision="bf16")
        cfg.model = dataclasses.replace(cfg.model, n_layers=4)
        calls[m] = simulate_rank(cfg, 16, 0).steps[-1].collectives["all_gather"]["calls"]
        plan = Plan(pp=2, dp_shard=8, zero_stage=zero, micro_batch=1, grad_accum=m, pp_schedule="1f1b")
        training = Training(seq_len=1024, global_batch=8 * m)
        comm[m] = evaluate(cfg.model, training, plan, Cluster(accelerator("h100"), 16)).time.detail["dp_comm_s"]
    if zero == 2:
        assert calls[4] == calls[8] and comm[4] == pytest.approx(comm[8])
    else:
        assert calls[8] > calls[4] and comm[8] > 1.5 * comm[4]


def test_a_pipeline_keeps_torchtitans_gradients_unsharded_until_the_last_micro_batch():
    # torchtitan reduce-scatters in every micro-batch's backward (it never turns gradient sync off), except in a
    # pipeline, whose schedule turns it off for all backwards but the step's last: there its gradients are kept
    # whole, in fp32 (FSDP2 accumulates them in the reduce dtype), as shardwise's engine keeps them
    args = dataclasses.replace(preset("llama3-8b"), n_layers=8)
    titan = _training("torchtitan", seq_len=4096, global_batch=64)
    assert titan.reduces_every_micro_batch(1) and not titan.reduces_every_micro_batch(2)
    from shardwise.planner.memory import stage_shape

    flat = Plan(dp_shard=8, zero_stage=2, micro_batch=1, grad_accum=8)
    piped = Plan(pp=2, dp_shard=4, zero_stage=2, micro_batch=1, grad_accum=16, pp_schedule="1f1b")
    # in the first block's backward of a micro-batch with more to come: the stage's weights gathered in bf16 (2
    # bytes) and, in the pipeline, its gradients whole in fp32 (4)
    held_flat = moment_memory(args, titan, flat, 0)["first_block_backward"]["fsdp_buffers"]
    held_piped = moment_memory(args, titan, piped, 0)["first_block_backward"]["fsdp_buffers"]
    assert held_flat == pytest.approx(2 * num_params(args))
    assert held_piped == pytest.approx(6 * stage_shape(args, piped, 0, 4096).params)


def test_a_float8_plan_says_what_its_mfu_divides_by(capsys):
    argv = ["--model", "llama3-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "16", "--top-k", "1",
            "--system", "torchtitan", "--compile", "--precision", "fp8"]
    assert run_plan(_ns(*argv)) == 0
    out = capsys.readouterr().out
    assert "system: torchtitan (compile)" in out and "MFU: model FLOPs over the bf16 peak" in out
    assert run_plan(_ns(*argv[:-2])) == 0
    assert "MFU: model FLOPs" not in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------
# Float8 through Transformer Engine (Megatron-Core, NeMo)


@pytest.mark.parametrize("recipe", ["te-delayed", "te-current"])
@pytest.mark.parametrize("name, t", [("llama3-8b", 1), ("llama3-70b", 8)])
def test_transformer_engine_casts_each_module_input_once_and_its_weights_once_per_step(name, t, recipe):
    # TE under Megatron-Core: Q/K/V one module and the MLP's gate + up one, so four input casts a block (the two
    # after a norm only transposed, the norm writing float8 itself), four output-gradient casts, and the weights
    # cast on a step's first micro-batch only; under tp each rank casts its shard of the column-parallel modules'
    # outputs (Q/K/V: a KV head per rank at tp 8) and of the row-parallel modules' inputs, and its share of every
    # weight. Counted here by hand from the modules' shapes, against the planner (the GEMMs are torchao's
    # recipe's; only the casts differ)
    from shardwise.planner.timing import float8_cast_seconds, linear_times

    args, acc, m = preset(name), accelerator("h100"), 16
    plan = Plan(tp=t, dp_replicate=8, zero_stage=1, micro_batch=1, grad_accum=m, sequence_parallel=t > 1)
    ao = dataclasses.replace(_training("megatron-core", seq_len=8192, global_batch=8 * m, precision="fp8"),
                             float8="torchao")
    te = dataclasses.replace(ao, float8=recipe)
    tokens, bw = 8192, acc.mem_bandwidth * acc.bandwidth_efficiency
    d, kv, f = args.dim, args.n_kv_heads * args.head_dim, args.ffn_hidden
    amax = 2 if recipe == "te-current" else 0
    weights = (d * (d + 2 * kv) + d * d + 2 * d * f + f * d) / t
    te_fwd = (tokens * ((2 + amax) * d + (4 + amax) * d / t + (2 + amax) * d + (4 + amax) * f / t)
              + (4 + amax) * weights / m) / bw
    te_bwd = (4 + amax) * tokens * ((d + 2 * kv) / t + d + 2 * f / t + d) / bw
    shards = ((d, d / t), (d, kv / t), (d, kv / t), (d / t, d), (d, f / t), (d, f / t), (f / t, d))
    ao_casts = [float8_cast_seconds(tokens, i, o, bw, fused=False) for i, o in shards]
    fwd_te, bwd_te, w_te = linear_times(args, te, plan, acc, tokens)
    fwd_ao, bwd_ao, w_ao = linear_times(args, ao, plan, acc, tokens)
    assert fwd_te - fwd_ao == pytest.approx(te_fwd - sum(c[0] for c in ao_casts), rel=1e-9)
    assert bwd_te - bwd_ao == pytest.approx(te_bwd - sum(c[1] for c in ao_casts), rel=1e-9)
    assert w_te == w_ao
    # ZeRO-3 gathers the weights again for every micro-batch: no cache to reuse, each micro-batch casts them
    sharded = dataclasses.replace(plan, dp_replicate=1, dp_shard=8, zero_stage=3)
    fwd_z3 = linear_times(args, te, sharded, acc, tokens)[0]
    assert fwd_z3 - fwd_te == pytest.approx((4 + amax) * weights * (1 - 1 / m) / bw, rel=1e-9)


def test_the_step_cost_memo_tells_cached_float8_weights_from_regathered_ones():
    # the same layout at ZeRO-2 (TE's float8 weights cached over the step) and at ZeRO-3 (cast every micro-batch):
    # asked in turn of a warm memo, each costs what it costs asked alone
    from shardwise.planner import timing

    args, cluster = preset("llama3-8b"), Cluster(accelerator("h100"), 8)
    te = _training("megatron-core", seq_len=8192, global_batch=128, precision="fp8")
    plans = [Plan(dp_shard=8, zero_stage=z, micro_batch=1, grad_accum=16) for z in (2, 3)]
    warm = [evaluate(args, te, p, cluster).time.step_time_s for p in plans]
    cold = []
    for p in plans:
        timing._STAGE_COSTS.clear()
        cold.append(evaluate(args, te, p, cluster).time.step_time_s)
    assert warm == cold


def test_transformer_engine_keeps_the_linears_inputs_in_float8():
    # TE saves each linear's quantised input for its weight gradient: the two norm outputs and the MLP's gate
    # product one byte an element instead of two, and the attention output projection's float8 input beside the
    # attention's own bf16 output. torchao's recipe keeps bf16 inputs: its float8 block keeps what a bf16 one does
    args = preset("llama3-8b")
    plan = Plan(dp_replicate=8, zero_stage=1, micro_batch=1, grad_accum=16)
    bf16 = _training("megatron-core", seq_len=8192, global_batch=128)
    ao = dataclasses.replace(bf16, precision="fp8", float8="torchao")
    te = dataclasses.replace(ao, float8="te-delayed")
    d, f, tokens = args.dim, args.ffn_hidden, 8192
    for recompute in ("none", "selective"):  # selective: Megatron's, the attention core recomputed
        kept = {t: layer_activation_bytes(args, t, plan, recompute=recompute) for t in (bf16, ao, te)}
        assert kept[ao] == kept[bf16]
        assert kept[bf16] - kept[te] == pytest.approx(tokens * ((d + d + f) - d))
    assert layer_activation_bytes(args, te, plan, recompute="full") == \
        layer_activation_bytes(args, bf16, plan, recompute="full")
    names = {t.name: t.kind for t in block_terms(args, te, "none", 1)}
    assert names["attention_norm_output"] == names["ffn_norm_output"] == names["swiglu_out"] == "f8"
    assert names["wo_input_f8"] == "f8" and names["sdpa_out"] == "act"


def test_lora_under_transformer_engines_float8_keeps_its_frozen_weights_in_float8(capsys):
    # NeMo's LoRA runs TE's float8 under the adapters with fp8_params (MLPerf v4.0's Llama 2 70B LoRA): each frozen
    # block linear is stored as a Float8Tensor, one byte a weight where bf16 takes two (the head stays bf16, TE's
    # float8 being the blocks'), and keeps no input (TE saves a linear's input only for its weight gradient); the
    # adapters run in bf16. torchao's recipe is not combined with LoRA: refused, as QLoRA's NF4 base is
    args = preset("llama2-7b")
    plan = Plan(tp=2, dp_replicate=4, zero_stage=1, micro_batch=1, grad_accum=2, sequence_parallel=True)
    lora = {"lora_rank": 16, "lora_targets": ("wq", "wk", "wv", "wo"), "lora_dropout": 0.1}
    bf16 = _training("megatron-core", seq_len=4096, global_batch=8, **lora)
    te = dataclasses.replace(bf16, precision="fp8", float8="te-delayed")
    assert te.float8_frozen_weights and not bf16.float8_frozen_weights
    assert dataclasses.replace(te, float8="te-current").float8_frozen_weights  # NeMo's FP8-CS alike
    with pytest.raises(PlannerError, match="QLoRA"):  # an NF4 base under float8: nothing runs it
        dataclasses.replace(te, qlora=True)
    cluster = Cluster(accelerator("h100"), 8)
    weights = {t: evaluate(args, t, plan, cluster).memory["params"] for t in (bf16, te)}
    d = args.dim
    linears = args.n_layers * (4 * d * d * (args.n_kv_heads / args.n_heads + 1) / 2 + 3 * d * args.ffn_hidden) / 2
    assert weights[bf16] - weights[te] == pytest.approx(linears, rel=1e-9)  # one byte a frozen block weight less
    # and so as gathered (Megatron-FSDP's ZeRO-3): per parameter of a block, its linears' share a byte less
    zero3, per_block = Plan(dp_shard=8, zero_stage=3, micro_batch=1), 2 * linears / args.n_layers
    gathered = {t: gathered_unit_bytes(args, t, zero3, 0)[0] for t in (bf16, te)}
    assert gathered[bf16] - gathered[te] == pytest.approx(per_block / (per_block + 2 * d), rel=1e-9)
    for recompute in ("none", "selective"):
        assert layer_activation_bytes(args, te, plan, recompute=recompute) == \
            layer_activation_bytes(args, bf16, plan, recompute=recompute)
    # the weights are not cast (no bf16 copy), each backward transposes them (1 + 1 bytes an element)
    modules, bandwidth = {"fc1": (4096.0, 2 * 11008.0, 4096 * 2 * 11008.0)}, 2.5e12
    cast_fwd, cast_bwd = te_float8_cast_seconds(modules, 4096, bandwidth, 4, current=False)
    kept_fwd, kept_bwd = te_float8_cast_seconds(modules, 4096, bandwidth, 4, current=False, stored=True)
    weight = modules["fc1"][2]
    assert cast_fwd - kept_fwd == pytest.approx(4 * weight / bandwidth / 4)
    assert kept_bwd - cast_bwd == pytest.approx(2 * weight / bandwidth)
    times = {t: evaluate(args, t, plan, cluster).time.step_time_s for t in (bf16, te)}
    assert times[te] < 0.8 * times[bf16]  # the frozen linears' forward and input-gradient GEMMs at the fp8 peak
    argv = ["--model", "llama2-7b", "--gpus", "8", "--seq-len", "4096", "--global-batch", "8", "--precision", "fp8",
            "--lora-rank", "16", "--top-k", "1"]
    assert run_plan(_ns(*argv, "--system", "megatron-core")) == 0
    capsys.readouterr()
    assert run_plan(_ns(*argv, "--system", "torchtitan")) == 2
    err = capsys.readouterr().err
    assert "--precision" in err and "Transformer Engine" in err and len(err.strip().splitlines()) == 1


def test_nemos_lora_adapts_a_fused_linear_with_one_adapter_and_megatrons_swiglu_can_keep_float8(tmp_path):
    # Megatron-Core computes Q/K/V as one linear (linear_qkv) and NeMo's LoRA adapts it with one adapter
    # (LoraKQVAdapter: one A of d x r, one dropout of its input): against an adapter per projection, two A's
    # (r d each), two dropped copies of the norm's output (bf16) and their masks (a byte an element) and two
    # x A^T (r wide) fewer. Megatron's activation_func_fp8_input_store keeps the fused SwiGLU's input (the w1 and
    # w3 outputs, 2f) in float8: a byte an element less
    args = preset("llama2-7b")
    plan = Plan(dp_replicate=8, zero_stage=1, micro_batch=1)
    fused = _training("megatron-core", seq_len=4096, global_batch=8, lora_rank=16, lora_dropout=0.1,
                      lora_targets=("wq", "wk", "wv", "wo"))
    apart = dataclasses.replace(fused, fused_projections=False)
    assert fused.fused_projections and [len(g) for g in adapter_groups(args, fused)] == [3, 1]
    d, r, f, tokens = args.dim, 16, args.ffn_hidden, 4096
    per_token = 2 * (2 * d + d + 2 * r)
    assert layer_activation_bytes(args, apart, plan, recompute="none") - \
        layer_activation_bytes(args, fused, plan, recompute="none") == pytest.approx(tokens * per_token)
    assert lora_params(args, apart) - lora_params(args, fused) == 2 * r * d
    # under sequence parallelism NeMo's adapter drops its input on the sequence shard and then gathers it: A keeps
    # the whole sequence, the mask a shard. An adapter on part of linear_qkv is not NeMo's to run
    kept = {t.name: t for t in block_terms(args, fused, "none", 1)}
    assert kept["attention_norm_output"].split == "full" and kept["wq_lora_dropout_mask"].split == "seq"
    for split in (("wq", "wv"), ("w1",)):
        with pytest.raises(PlannerError, match="--lora-targets"):
            check_recipe(args, dataclasses.replace(fused, lora_targets=split))
    check_recipe(dataclasses.replace(args, mlp="gelu"), dataclasses.replace(fused, lora_targets=("w1",)))  # no w3
    fp8_in = dataclasses.replace(fused, activation_fp8_input=True)
    assert layer_activation_bytes(args, fused, plan, recompute="none") - \
        layer_activation_bytes(args, fp8_in, plan, recompute="none") == pytest.approx(tokens * 2 * f)
    with pytest.raises(PlannerError, match="activation_fp8_input"):
        dataclasses.replace(_training("torchtitan"), activation_fp8_input=True)
    for base, ok in (("megatron-core", True), ("torchtitan", False)):  # a system file says it, or is refused
        path = tmp_path / f"{base}-fp8-swiglu.toml"
        path.write_text(f'base = "{base}"\nactivation_fp8_input = true\n')
        if ok:
            assert resolve_system(str(path)).training_fields()["activation_fp8_input"]
        else:
            with pytest.raises(PlannerError, match="--system activation_fp8_input"):
                resolve_system(str(path))


def test_megatron_fsdp_reduce_scatters_every_micro_batch_into_its_shard():
    # Megatron-Core's ZeRO-2/3 is Megatron-FSDP, whose gradient buffer holds only the rank's shard: each micro-batch's
    # gradients are reduce-scattered in its backward, none kept whole (the planner held them whole in fp32, as
    # Megatron's DDP buffer, until NeMo's FSDP run showed the difference); its ZeRO-1 (the distributed optimizer)
    # keeps the whole fp32 buffer and reduces once per step
    args = dataclasses.replace(preset("llama3-8b"), n_layers=8)
    mc = _training("megatron-core", seq_len=4096, global_batch=64)
    assert mc.reduces_every_micro_batch(1)
    held, comm = {}, {}
    for m in (4, 8):
        plan = Plan(dp_shard=8, zero_stage=3, micro_batch=1, grad_accum=m)
        held[m] = moment_memory(args, mc, plan, 0)["first_block_backward"]["fsdp_buffers"]
        comm[m] = evaluate(args, dataclasses.replace(mc, global_batch=8 * m), plan,
                           Cluster(accelerator("h100"), 8)).time.detail["dp_comm_s"]
    # gathered weights (the root unit, the running and next blocks) and one block's gradients: less than the whole
    # fp32 gradients alone, and the same whatever the accumulation
    assert held[4] == held[8] < 4 * num_params(args) / 2
    # every collective once per micro-batch, the gradients' reduce-scatter too (held whole, they would be reduced
    # once per step: 1.8x)
    assert comm[8] == pytest.approx(2 * comm[4], rel=1e-9)
    one = Plan(dp_replicate=8, zero_stage=1, micro_batch=1, grad_accum=8)
    grads = moment_memory(args, mc, one, 0)["first_block_backward"]["grads"]
    assert grads == pytest.approx(4 * num_params(args))  # ZeRO-1: the whole fp32 buffer


def test_a_float8_plan_names_its_recipe(tmp_path, capsys):
    argv = ["--model", "llama3-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "128", "--top-k", "1",
            "--precision", "fp8"]
    assert run_plan(_ns(*argv, "--system", "megatron-core")) == 0
    assert "Transformer Engine's float8 (delayed scaling)" in capsys.readouterr().out
    path = tmp_path / "mcore-cs.toml"  # NeMo's FP8-CS: the tensorwise recipe, each cast after an amax pass
    path.write_text('base = "megatron-core"\nfloat8 = "te-current"\n')
    assert run_plan(_ns(*argv, "--system", str(path))) == 0
    assert "Transformer Engine's float8 (current scaling)" in capsys.readouterr().out
    assert run_plan(_ns(*argv, "--system", "torchtitan")) == 0
    assert "Transformer Engine" not in capsys.readouterr().out


def test_nemo_float8_runs_fit_and_come_within_their_family_bound():
    # NVIDIA's NeMo / Megatron Bridge performance summaries: Megatron-Core in float8 on DGX-H100 (GPT-3 5B to
    # 175B, Llama 2 and 3 from 7B to 405B, Nemotron 8B to 340B, tp, pp, cp and interleaving as printed). Every run
    # that ran is predicted to fit; with TE's casts and float8-saved inputs the family's median error is under 10%
    # (3.1% since NeMo 24.07's rows but GPT-3 175B's are described with flash-attn and its GPT-3 and Llama rows
    # with bf16 gradient reduction, both inferred from its launcher's settings, 5.2% before; with torchao's recipe
    # in its place, which casts per linear and saves bf16, it is 11.3%, 3.6 times as far off, every row slower;
    # 11.8% before Megatron-Core's weight gathers hid behind the forward, 15% before its interleaved pipeline
    # sends were overlapped, 17% before torchao's TP gathers were priced in float8)
    published = _published_module()
    runs = [run for run in published.nemo_runs() if run.gpu == "h100"]
    assert len(runs) == 17
    errors, before = [], []
    for run in runs:
        ev, fits = published.given_plan(run)
        assert fits, run.name
        errors.append(abs(run.published_step() / ev.time.step_time_s - 1))
        ao = dataclasses.replace(run, float8="torchao")
        ev_ao, _ = published.given_plan(ao)
        before.append(abs(run.published_step() / ev_ao.time.step_time_s - 1))
        assert ev_ao.time.step_time_s > ev.time.step_time_s, run.name  # TE casts once per module and weight
    assert sorted(errors)[len(errors) // 2] < 0.10
    assert sorted(before)[len(before) // 2] > 1.5 * sorted(errors)[len(errors) // 2]  # TE's recipe is the one


def test_nemo_runs_of_2024_priced_with_flash_attn_as_their_launcher_ran_them():
    # NeMo's launcher set NVTE_FUSED_ATTN=0 for every job from February to August 2024 (its tags 24.01 to 24.07) but,
    # from 13 August, GPT-3 175B's, so Transformer Engine ran flash-attn 2 where `--system megatron-core` says cuDNN
    # (NEMO_FLASH_ATTN, inferred from the launcher's settings). NeMo 24.03.01's long-sequence table (Llama 2 7B in
    # FP8, 4K to 1M tokens, context parallel up to 32) came out 1.14 to 1.60 optimistic with cuDNN's measured share,
    # rising with the attention's share of the step; with flash-attn's, 0.89 to 1.03 (median 8.9%). NeMo 24.07's ten
    # rows on flash-attn (its GPT-3 175B two stay on cuDNN) 3.0% at the median, 8.4% with cuDNN's. The launcher's
    # GPT-3 and Llama scripts reduce the gradients in bf16 (grad_sync_dtype): those rows are described so, and the
    # description reaches the planner (their predicted memory is below fp32 gradients'); the Nemotron-8B and -22B
    # scripts do not. The GPT-3 configs keep Megatron's dropout of 0.1
    published = _published_module()
    nemo_2407 = [r for r in published.nemo_runs() if r.name.startswith("NeMo 24.07")]
    assert {r.name for r in nemo_2407 if r.attention_kernel is None} == {"NeMo 24.07 175B n=128",
                                                                          "NeMo 24.07 175B n=512"}
    for runs, bound, cudnn_worse_than in ((published.nemo_long_runs(), 0.10, 0.30),
                                         ([r for r in nemo_2407 if r.attention_kernel], 0.04, 0.06)):
        errors, with_cudnn = [], []
        for run in runs:
            assert run.attention_kernel == "flash2", run.name
            ev, fits = published.given_plan(run)
            assert fits, run.name
            errors.append(abs(run.published_step() / ev.time.step_time_s - 1))
            ev_cudnn, _ = published.given_plan(dataclasses.replace(run, attention_kernel=None))
            assert ev_cudnn.time.step_time_s < ev.time.step_time_s, run.name  # cuDNN's kernel is the faster
            with_cudnn.append(abs(run.published_step() / ev_cudnn.time.step_time_s - 1))
        assert sorted(errors)[len(errors) // 2] < bound
        assert sorted(with_cudnn)[len(with_cudnn) // 2] > cudnn_worse_than
    for run in nemo_2407 + published.nemo_long_runs():
        nemotron = run.name.startswith(("NeMo 24.07 nemotron-8b", "NeMo 24.07 nemotron-22b"))
        assert run.grads_in_fp32 is (None if nemotron else False), run.name
        assert run.dropout is (True if run.model.name in published.NEMO_GPT else None), run.name  # GPT-3's 0.1
        if not nemotron and "nemotron4" not in run.name:
            ev, _ = published.given_plan(run)
            ev_fp32, _ = published.given_plan(dataclasses.replace(run, grads_in_fp32=None))
            assert ev.memory["total"] < ev_fp32.memory["total"], run.name


def test_torchtitan_405b_pipelines_within_10_percent():
    # tables 5 and 6 (405B on FSDP 8 x TP 8 x PP 8, compile + Float8, full recompute): 1F1B and interleaved at 8K
    # (100 and 128 tokens/s per GPU) and 1F1B at 32K (76). Their FSDP is ZeRO-2 (no reshard after forward in a
    # pipeline), gathered once per step, its gradients kept whole until the last micro-batch: priced so, each row
    # within 10% (with a gather and a reduce-scatter per micro-batch, 1F1B came out at 0.88); AsyncTP, which these
    # rows also ran, is not modelled
    published = _published_module()
    runs = [run for run in published.torchtitan_runs() if "405B" in run.name and " CP " not in run.name]
    assert len(runs) == 3
    ratios = {}
    for run in runs:
        ev, fits = published.given_plan(run)
        assert fits and ev.plan.zero_stage == 2 and ev.plan.pp == 8, run.name
        ratios[run.name] = run.published_step() / ev.time.step_time_s
    assert all(abs(r - 1) <= 0.10 for r in ratios.values()), ratios
    # and the interleaved schedule is the faster, as measured
    steps = {run.name: published.given_plan(run)[0].time.step_time_s for run in runs if "s=8K" in run.name}
    interleaved = next(name for name in steps if "i1F1B" in name)
    assert steps[interleaved] == min(steps.values())


@pytest.mark.parametrize("argv, flag", [
    (["--model", "llama3-8b", "--gpus", "8", "--compile", "--plan", "pp=2,pp_schedule=zero-bubble"], "--compile"),
    (["--model", "llama3-8b", "--gpus", "8", "--precision", "fp16", "--plan", "pp=2"], "--precision"),
    (["--model", "mixtral-8x7b", "--gpus", "64", "--precision", "fp8"], "--precision"),
    (["--model", "llama3-8b", "--gpus", "1", "--lora-rank", "16", "--precision", "fp8"], "--precision"),
    (["--model", "llama3-8b", "--gpus", "8", "--gpu", "a100", "--precision", "fp8"], "--precision"),
])
def test_what_the_planner_cannot_price_or_the_engine_run_names_the_flag(argv, flag, capsys):
    assert run_plan(_ns(*argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"shardwise: error: {flag}:") and len(err.splitlines()) == 1 and "train." not in err


def test_write_config_refuses_a_plan_that_does_not_fit(tmp_path, capsys):
    path = tmp_path / "job.toml"
    argv = ["--model", "llama3-70b", "--gpus", "8", "--plan", "dp_shard=8,activation_checkpoint=none",
            "--write-config", str(path)]
    assert run_plan(_ns(*argv)) == 2
    err = capsys.readouterr().err
    assert "--write-config" in err and "would not fit" in err and not path.exists()


def test_a_given_pipeline_that_does_not_fit_is_reported_with_the_micro_batch_its_split_implies(capsys):
    # 64 sequences over dp 4 in 2 pipeline micro-batches: micro-batches of 8 sequences (it was refused, reading a
    # micro-batch of 1: "micro_batch*grad_accum*dp = 8 != 64")
    argv = ["--model", "llama3-8b", "--gpus", "16", "--global-batch", "64", "--system", "torchtitan", "--json",
            "--plan", "pp=4,dp_shard=4,zero_stage=3,pp_schedule=gpipe,pp_microbatches=2,activation_checkpoint=none"]
    assert run_plan(_ns(*argv)) in (0, 1)
    import json

    plan = json.loads(capsys.readouterr().out)["plans"][0]
    assert (plan["micro_batch"], plan["grad_accum"], plan["dp"]) == (8, 2, 4)


def test_distributed_checkpoints_split_the_saved_input_and_gather_it_again():
    # Megatron's --distribute-checkpointed-activations (metaseq's OPT-175B): under full recompute on tp 8 without
    # sequence parallelism each block keeps 1/8 of its input (fp16, d per token) and all-gathers it over tp
    # before recomputing: one all-gather of the whole input per block and micro-batch on the tp link
    from shardwise.planner.comm import all_gather, axis_link
    from shardwise.planner.timing import stage_cost

    args = ModelArgs(name="gpt", dim=12288, n_layers=4, n_heads=96, n_kv_heads=96, vocab_size=50272,
                     ffn_hidden=4 * 12288, mlp="gelu", max_seq_len=2048)
    plain = Training(seq_len=2048, global_batch=8, layout="megatron", precision="fp16", fused_attention=False,
                     dropout=True, elementwise="fused", loss_parallel=True)
    split = dataclasses.replace(plain, distribute_checkpoints=True)
    plan = Plan(tp=8, micro_batch=8, grad_accum=1, activation_checkpoint="full", sequence_parallel=False)
    tokens = 8 * 2048
    assert layer_activation_bytes(args, plain, plan) == pytest.approx(tokens * args.dim * 2)
    assert layer_activation_bytes(args, split, plan) == pytest.approx(tokens * args.dim * 2 / 8)
    cluster = Cluster(accelerator("a100-80gb"), 8)
    _, link = axis_link(plan, ("tp",), cluster, spread=True)
    gathers = stage_cost(args, split, plan, cluster).tp_comm - stage_cost(args, plain, plan, cluster).tp_comm
    assert gathers == pytest.approx(args.n_layers * all_gather(tokens * args.dim * 2, 8, link))
    # with sequence parallelism the input is kept split already (no gather added); without full recompute nothing
    # is distributed
    sp = dataclasses.replace(plan, sequence_parallel=True)
    assert stage_cost(args, split, sp, cluster).tp_comm == stage_cost(args, plain, sp, cluster).tp_comm
    for recompute in ("selective", "none"):
        kept = dataclasses.replace(plan, activation_checkpoint=recompute)
        assert layer_activation_bytes(args, split, kept) == layer_activation_bytes(args, plain, kept)
        assert stage_cost(args, split, kept, cluster).tp_comm == stage_cost(args, plain, kept, cluster).tp_comm


def test_kept_bf16_grads_add_two_unsharded_bytes_a_parameter():
    # DeepSpeed's BF16_Optimizer keeps autograd's bf16 gradients beside its fp32 buffer (backward() with
    # clear_lp_grads=False): 2 bytes a trainable parameter on top of the layout's gradients, at ZeRO 0-1 without
    # offload and on bf16 weights, where DeepSpeed runs that optimizer; nowhere else
    from shardwise.planner.memory import model_state_bytes

    plain = Training(seq_len=2048, global_batch=8, layout="megatron")
    kept = dataclasses.replace(plain, keeps_bf16_grads=True)
    for stage, shard in ((0, 1), (1, 8)):
        a = model_state_bytes(1e9, plain, stage, shard)
        b = model_state_bytes(1e9, kept, stage, shard)
        assert b["grads"] - a["grads"] == pytest.approx(2e9)
        assert {k: v for k, v in a.items() if k != "grads"} == {k: v for k, v in b.items() if k != "grads"}
    assert model_state_bytes(1e9, kept, 2, 8) == model_state_bytes(1e9, plain, 2, 8)  # its ZeRO optimizer
    assert model_state_bytes(1e9, kept, 1, 8, "optimizer") == model_state_bytes(1e9, plain, 1, 8, "optimizer")
    for other in (dict(layout="fsdp-mp"), dict(precision="fp32")):  # fp32 weights: no bf16 gradients to keep
        a, b = (Training(seq_len=2048, global_batch=8, keeps_bf16_grads=k, **other) for k in (False, True))
        assert model_state_bytes(1e9, a, 1, 8) == model_state_bytes(1e9, b, 1, 8)


def test_kept_bf16_grads_are_added_into_fp32_after_every_micro_batch():
    # update_hp_grads after each micro-batch's backward: hp.add_(lp.grad.to(fp32)) reads 2 + 4 + 4 and writes
    # 4 + 4 bytes a parameter, over the stage's parameters at the elementwise bandwidth, in every pipeline slot
    from shardwise.planner.memory import stage_shape
    from shardwise.planner.timing import stage_cost

    args = ModelArgs(name="gpt", dim=4096, n_layers=8, n_heads=32, n_kv_heads=32, vocab_size=50304,
                     ffn_hidden=4 * 4096, mlp="gelu", max_seq_len=2048)
    plain = Training(seq_len=2048, global_batch=64, layout="megatron", fused_attention=False, dropout=True,
                     elementwise="fused", loss_parallel=True)
    kept = dataclasses.replace(plain, keeps_bf16_grads=True)
    plan = Plan(tp=2, pp=2, dp_replicate=2, zero_stage=1, micro_batch=2, grad_accum=16, activation_checkpoint="full")
    acc = accelerator("a100-80gb")
    cluster = Cluster(acc, 8)
    params = max(stage_shape(args, plan, s, 2048).params for s in range(2))
    delta = stage_cost(args, kept, plan, cluster).total - stage_cost(args, plain, plan, cluster).total
    assert delta == pytest.approx(params * 18 / (acc.mem_bandwidth * acc.bandwidth_efficiency))
    zero2 = dataclasses.replace(plan, dp_replicate=1, dp_shard=2, zero_stage=2)
    assert stage_cost(args, kept, zero2, cluster).total == stage_cost(args, plain, zero2, cluster).total


def test_megatron_core_gathers_the_updated_weights_behind_the_next_forward(tmp_path):
    # Megatron-Core's distributed optimizer with --overlap-param-gather (its README's scaling runs, NeMo's recipes
    # wherever dp > 1): the forward pre-hook of a bucket's first module waits on that bucket's all-gather and starts
    # the next one's (param_and_grad_buffer.py finish_param_sync, core_r0.11), so one gather is in flight behind
    # the forward and only the first waits; without it the optimizer step gathers every weight before the next
    # forward. Buckets hold the parameters in reverse order (distributed_data_parallel.py), so the forward's first
    # holds the input embedding and the end of the first block: priced as the embedding and one block's weights.
    # Llama 3 8B, bf16 weights, ZeRO-1, by hand from the collective's price: on dp 8 (one H100 node) the forward hides
    # the rest of the gather; at 1,024 tokens a rank on dp 64 (8 nodes) it hides only the forward's length of it
    from shardwise.planner.comm import all_gather, axis_link

    args = preset("llama3-8b")
    assert _training("megatron-core").overlap_param_gather and not _training("torchtitan").overlap_param_gather
    embedding = args.vocab_size * args.dim
    for gpus, seq in ((8, 8192), (64, 1024)):
        mcore = _training("megatron-core", seq_len=seq, global_batch=gpus * 8)
        cluster = Cluster(accelerator("h100"), gpus)
        plan = Plan(dp_replicate=gpus, zero_stage=1, micro_batch=1, grad_accum=8)
        exposed = evaluate(args, mcore, plan, cluster).time.detail
        blocking = evaluate(args, dataclasses.replace(mcore, overlap_param_gather=False), plan, cluster).time.detail
        n, link = axis_link(plan, plan.shard_axes, cluster, spread=True)
        assert n == gpus
        ag = all_gather(num_params(args) * 2, n, link)  # bf16 weights
        first = ag / args.n_layers + ag * embedding / num_params(args)
        forward = stage_cost(args, mcore, plan, cluster).forward
        assert (ag - first < forward) == (gpus == 8)
        # NCCL's CTAs hold their SMs from the compute they hide behind (Link.sm_share): that share stays exposed
        hidden = cluster.accelerator.comm_overlap * (1 - link.sm_share) * min(ag - first, forward)
        assert 0 < link.sm_share < 0.5
        assert blocking["dp_exposed_s"] - exposed["dp_exposed_s"] == pytest.approx(hidden, rel=1e-9)
        assert blocking["dp_comm_s"] == pytest.approx(exposed["dp_comm_s"])
    # other layouts gather as their systems do, and are refused the knob; a system file can turn it off
    with pytest.raises(PlannerError, match="overlap_param_gather"):
        dataclasses.replace(_training("torchtitan"), overlap_param_gather=True)
    path = tmp_path / "megatron-lm.toml"
    path.write_text('base = "megatron-core"\noverlap_param_gather = false\n')
    edited = Training(seq_len=4096, global_batch=8, **resolve_system(str(path)).training_fields())
    assert not edited.overlap_param_gather
    from shardwise.planner.cli import system_summary
    assert "gathered behind the next forward" in system_summary(mcore)  # the preset's own summary
    assert ", the updated weights gathered behind the next forward" in system_summary(
        dataclasses.replace(mcore, system="edited"))


def test_megatron_lm_of_2021_reduces_the_gradients_after_the_backward(tmp_path):
    # Megatron-LM before --overlap-grad-reduce (September 2023) all-reduced the main gradients after
    # forward_backward_func (train_step: allreduce_gradients, or the distributed optimizer's reduce_model_grads), as
    # NeMo 1's Megatron GPT of 2022 and DeepSpeed's pipeline engine (ReduceGrads after the last backward) did: none
    # of it behind the backward. Megatron-Core (and torch's DDP and FSDP) reduce bucket by bucket during it, the
    # last bucket exposed. NeMo's GPT-3 5B of 2022 on 16 A100s, by hand from the collectives' prices.
    from shardwise.planner.comm import all_gather, all_reduce, axis_link, reduce_scatter
    from shardwise.planner.timing import _max_stage_params

    args = ModelArgs(name="gpt3-5b", dim=4096, n_heads=32, n_kv_heads=32, n_layers=24, vocab_size=50432,
                     ffn_hidden=16384, mlp="gelu", max_seq_len=2048)
    old, core = _training("megatron-lm-2021", seq_len=2048, global_batch=64), _training("megatron-core")
    assert not old.overlap_grad_reduce and core.overlap_grad_reduce
    cluster = Cluster(accelerator("a100-80gb"), 16)
    for zero in (0, 1):
        plan = Plan(tp=2, dp_replicate=8, zero_stage=zero, micro_batch=2, grad_accum=4)
        after = evaluate(args, old, plan, cluster).time.detail
        during = evaluate(args, dataclasses.replace(old, overlap_grad_reduce=True), plan, cluster).time.detail
        n, link = axis_link(plan, ("dp_replicate",), cluster, spread=True)
        rank_params = _max_stage_params(args, old, plan)  # a tp rank's: half the matrices, the norms whole
        assert rank_params == pytest.approx(num_params(args) / 2, rel=1e-3)
        grads = rank_params * 4  # fp32 main gradients
        reduction = all_reduce(grads, n, link) if zero == 0 else reduce_scatter(grads, n, link)
        gather = 0.0 if zero == 0 else all_gather(rank_params * 2, n, link)  # the updated bf16 weights
        assert after["dp_comm_s"] == pytest.approx(reduction + gather, rel=1e-9) == during["dp_comm_s"]
        assert after["dp_exposed_s"] == pytest.approx(after["dp_comm_s"], rel=1e-9)
        cost = stage_cost(args, old, plan, cluster)
        backward = cost.backward_input + cost.backward_weight + cost.recompute
        hidden = cluster.accelerator.comm_overlap * (1 - link.sm_share) * min(reduction * (1 - 1 / 24), backward)
        assert after["dp_exposed_s"] - during["dp_exposed_s"] == pytest.approx(hidden, rel=1e-9)
        assert hidden > 0
    # FSDP's and shardwise's hooks reduce during the backward: refused there; a system file can set it
    for system in ("torchtitan", "shardwise", "llm-foundry"):
        with pytest.raises(PlannerError, match="overlap_grad_reduce"):
            dataclasses.replace(_training(system), overlap_grad_reduce=False)
    path = tmp_path / "megatron-lm-2022.toml"
    path.write_text('base = "megatron-core"\noverlap_grad_reduce = false\n')
    edited = Training(seq_len=4096, global_batch=8, **resolve_system(str(path)).training_fields())
    assert not edited.overlap_grad_reduce
    path.write_text('base = "megatron-core"\noverlap_grad_reduce = "no"\n')
    with pytest.raises(PlannerError, match="overlap_grad_reduce"):
        resolve_system(str(path))
    # DeepSpeed's ZeRO engine (layout zero) outside a pipeline: with overlap_comm its ZeRO-2 reduce-scatters hide
    # behind the backward, unless the field says after it; without overlap_comm (DeepSpeed's default below ZeRO-3)
    # ZeRO-1 reduces after the backward and ZeRO-2's hooks reduce on the compute stream: all exposed either way.
    # ZeRO-3's hooks reduce during the backward whatever the field says
    ds = _training("deepspeed", seq_len=2048, global_batch=64)
    assert not ds.overlap_comm and not ds.grad_reduce_hidden
    overlapped = dataclasses.replace(ds, overlap_comm=True)
    for zero, moved in ((1, True), (2, True), (3, False)):
        plan = (Plan(dp_replicate=16, zero_stage=zero, micro_batch=2, grad_accum=2) if zero < 2 else
                Plan(dp_shard=16, zero_stage=zero, micro_batch=2, grad_accum=2))
        during = evaluate(args, overlapped, plan, cluster).time.detail
        after = evaluate(args, dataclasses.replace(overlapped, overlap_grad_reduce=False), plan, cluster).time.detail
        default = evaluate(args, ds, plan, cluster).time.detail
        assert after["dp_comm_s"] == pytest.approx(during["dp_comm_s"], rel=1e-9) == default["dp_comm_s"]
        assert (after["dp_exposed_s"] > during["dp_exposed_s"]) == moved
        assert default["dp_exposed_s"] == pytest.approx(after["dp_exposed_s"], rel=1e-9)
        if moved:
            assert after["dp_exposed_s"] == pytest.approx(after["dp_comm_s"], rel=1e-9)
    # --layout keeps the field where it means something (megatron, zero) and resets it elsewhere
    from shardwise.planner.cli import _left_with_the_layout, system_summary
    preset_ = SYSTEMS["megatron-lm-2021"]
    assert "overlap_grad_reduce" not in _left_with_the_layout(preset_, "zero")
    assert _left_with_the_layout(preset_, "torch")["overlap_grad_reduce"] is True
    assert ", gradients reduced after the backward" in system_summary(dataclasses.replace(old, system="edited"))


def test_deepspeed_with_hugging_face_llama_on_h200s_long_sequences():
    # Bekman's benchmark (stas00/ml-engineering, insights/when-to-upgrade-gpus): Llama-3.1-8B by DeepSpeed ZeRO-3 with
    # the optimizer on the CPU, checkpointing, Liger-Kernel and FlashAttention-3 on 8 H200s, 8K to 256K tokens,
    # described by benchmarks/systems/deepspeed-hf-liger.toml. From 32K up, where attention is most of the step, each
    # row is within 10% once FlashAttention-3 is priced at its measured Hopper share (with FlashAttention-2's, as
    # held out, they were 0.51-0.80), and from 64K up its peak reserved memory within 5%. Left out, and documented
    # as gaps (docs/planner.md, "Known gaps"): the 8K step (1.34: the CPU's Adam, priced at host memory bandwidth)
    # and the memory at 8K and 32K (0.77, 0.84: DeepSpeed's buckets, not counted)
    published = _published_module()
    runs = [run for run in published.bekman_runs() if "ZeRO-3" in run.name]
    assert [run.seq // 1024 for run in runs] == [8, 32, 64, 128, 192, 256]
    assert published.training_of(runs[0]).attention_kernel == "flash3"
    for run in runs:
        ev, fits = published.given_plan(run)
        assert fits and ev.plan.offload == "optimizer", run.name
        ratio = run.published_step() / ev.time.step_time_s
        if run.seq >= 32768:
            assert 0.90 <= ratio <= 1.10, (run.name, ratio)
            flash2 = dataclasses.replace(published.training_of(run), attention_kernel="flash2")
            assert run.published_step() / evaluate(run.model, flash2, ev.plan,
                                                   published.cluster_of(run)).time.step_time_s < 0.85
        if run.seq >= 65536:
            assert published.published_memory(ev, run) / GiB == pytest.approx(run.mem_gib, rel=0.05), run.name


def test_a_bf16_model_keeps_two_bytes_of_weight_and_gradient_and_four_of_adamw_state_as_torch_stores_them():
    # torchtune trains the model it builds in bf16 (dtype: bf16, set_default_dtype): no fp32 copy, and torch's AdamW
    # keeps its moments in the parameter's dtype. Counted on a real step of a bf16 shardwise model (foreach and fused
    # alike), the planner's state_dtype bf16 gives the same bytes a parameter: 2 + 2 + 4 (8 against mixed
    # precision's 16), and the low-bit AdamWs, quantised whatever the weights' dtype, keep theirs
    from shardwise.planner.memory import state_bytes_per_param

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden=128, max_seq_len=32)
    tune = _training("torchtune")
    assert tune.state_dtype == "bf16" and tune.layout == "fsdp-mp"
    b = state_bytes_per_param(tune)
    for fused in (False, True):
        model = build_model(args)
        materialize(model, args, "cpu", 0)
        model.to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=not fused, fused=fused or None)
        model(torch.randint(0, 128, (2, 16))).float().logsumexp(-1).mean().backward()
        opt.step()
        params = list(model.parameters())
        n = sum(p.numel() for p in params)
        state = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")
        assert sum(p.numel() * p.element_size() for p in params) / n == b.params == 2
        assert sum(p.grad.numel() * p.grad.element_size() for p in params) / n == b.grads == 2
        assert state / n == b.optimizer == 4 and b.master == 0
    assert sum(dataclasses.astuple(state_bytes_per_param(_training("torchtitan")))) == 16  # fp32 shards, 4 + 4 + 8
    low_bit = state_bytes_per_param(_training("torchtune", optimizer="adamw8bit"))
    assert low_bit.optimizer == state_bytes_per_param(_training("torchtitan", optimizer="adamw8bit")).optimizer
    # torchao quantises a bf16 model's embedding too (only shardwise's engine keeps it out), and the pieces it leaves
    # unquantised keep bf16 moments: the tied 3B's 394M-value embedding at 2.03 bytes, not 8
    from shardwise.planner.memory import low_bit_state

    one = Plan(micro_batch=1)
    tune8, titan8 = (low_bit_state(preset("llama3.2-3b"), _training(name, optimizer="adamw8bit"), one, 0)
                     for name in ("torchtune", "torchtitan"))
    embedding = 128256 * 3072
    assert titan8 - tune8 == pytest.approx(embedding * (8 - 2 - 2 * 4 / 256), rel=0.01)


def test_a_bf16_model_is_refused_where_it_is_not_one_and_reset_by_the_flags_that_leave_it():
    from shardwise.planner.workload import recipe_for

    for wrong in ({"layout": "megatron"}, {"precision": "fp32"}, {"precision": "fp16", "reduce_dtype": "fp16"}):
        with pytest.raises(PlannerError, match="state_dtype") as refused:
            dataclasses.replace(_training("torchtune"), **wrong)
        assert refused.value.field == "--system state_dtype"
    # unsharded it stays the bf16 model (FSDP's policy is not what makes it bf16), where an fp32-sharded system's
    # recipe falls back to autocast
    single = Plan(dp_shard=1, zero_stage=0)
    assert recipe_for(_training("torchtune"), single).layout == "fsdp-mp"
    assert recipe_for(_training("torchtitan"), single).layout == "torch"
    argv = ["--model", "llama3.2-3b", "--gpus", "1", "--system", "torchtune"]
    assert system_of(_ns(*argv)).state_dtype == "bf16"
    fp32 = system_of(_ns(*argv, "--precision", "fp32"))
    assert (fp32.state_dtype, fp32.reduce_dtype) == ("fp32", "fp32") and "state_dtype fp32" in fp32.name
    zero = system_of(_ns(*argv, "--layout", "zero"))
    assert zero.state_dtype == "fp32" and "state_dtype fp32" in zero.name  # twice the bytes: said
    with pytest.raises(PlannerError, match="bf16 or fp32") as refused:
        system_of(_ns(*argv, "--precision", "fp16"))
    assert refused.value.field == "--precision"
    assert system_of(_ns(*argv, "--precision", "fp16", "--layout", "zero")).state_dtype == "fp32"  # not the bf16 model


def test_torchtunes_optimization_flags_table_held_out_fits_and_its_memory_is_within_10_percent():
    # torchtune's README table (Llama 3.2 3B on one A100, batch 2 x 4096 packed; torch's peak active bytes), held
    # out on 2026-12-06 in two sets (docs/heldout-2026-12-06/torchtune-*): as the planner stood, the packed and
    # compiled rows were predicted not to fit (88.6 and 83.4 GiB against 60.0 and 51.0: fp32 weights and AdamW state
    # under autocast), every full row's memory was 1.48 to 1.93 times the published and, with the bf16 model
    # described, LoRA's and QLoRA's 1.41 and 1.78 (the chunked loss, activation offloading and the optimizer in
    # backward undescribed), QLoRA's time 0.77 (torchao's dequantisation priced eager under compile). Now every row
    # fits, every memory but QLoRA's is within 10% (QLoRA 1.18: docs/planner.md, "torchtune's table, held out"),
    # and every time within 10%
    published = _published_module()
    rows = published.torchtune_runs()
    assert len(rows) == 8 and all(run.mem_counts == "active" for run in rows)
    for run in rows:
        ev, fits = published.given_plan(run)
        assert fits, run.name
        memory = published.published_memory(ev, run) / GiB / run.mem_gib
        assert memory == pytest.approx(1, abs=0.2 if run.qlora else 0.1), run.name
        assert run.published_step() / ev.time.step_time_s == pytest.approx(1, abs=0.1), run.name
    packed = rows[0]
    as_it_stood = dataclasses.replace(packed, system="torchtitan", fused_rmsnorm=False)
    ev, fits = published.given_plan(as_it_stood)
    assert not fits and published.published_memory(ev, packed) / GiB > 1.4 * packed.mem_gib


def _chunk_loss_backward_peak(chunks: int, tokens: int, vocab: int, dim: int, eager: bool = False) -> int:
    """Bytes the backward of a loss over `chunks` chunks of bf16 logits holds beyond what forward left, as torchtune
    computes it: the head applied chunk by chunk (TransformerDecoder.chunked_output) and each chunk's cross-entropy
    its own node, as a compiled call is: one that keeps its bf16 input and each row's log-sum-exp and whose backward
    writes the gradient in the logits' dtype in one pass (softmax minus the one-hot, no fp32 copy); `eager`: torch's
    cross-entropy over each chunk's fp32 upcast, as the uncompiled loss runs."""

    class ChunkCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, labels):
            lse = torch.logsumexp(logits.float(), -1)
            ctx.save_for_backward(logits, lse, labels)
            return (lse - logits.gather(-1, labels[:, None]).squeeze(-1).float()).sum()

        @staticmethod
        def backward(ctx, grad):
            logits, lse, labels = ctx.saved_tensors
            out = torch.softmax(logits, -1)  # the one tensor it writes
            out.scatter_add_(-1, labels[:, None], torch.full_like(labels[:, None], -1, dtype=out.dtype))
            return out.mul_(grad), None

    torch.manual_seed(0)
    h = torch.randn(tokens, dim, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, dim, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    with PeakBytes() as probe:
        logits = [torch.nn.functional.linear(c, weight) for c in h.chunk(chunks)]
        if eager:
            loss = sum(torch.nn.functional.cross_entropy(c.float(), y, reduction="sum")
                       for c, y in zip(logits, labels.chunk(chunks)))
        else:
            loss = sum(ChunkCrossEntropy.apply(c, y) for c, y in zip(logits, labels.chunk(chunks)))
        del logits  # torchtune's recipe: "free logits otherwise it peaks backward memory"
        before = probe.peak = probe.total
        loss.backward()
    return probe.peak - before


def test_a_chunked_loss_holds_one_chunks_gradient_beyond_its_saved_logits():
    # torchtune's CEWithChunkedOutputLoss (Training.loss_chunks): autograd runs every chunk's loss node before the
    # head's, each freeing its saved logits as it writes its gradient, so the loss's backward holds one chunk's
    # gradient beyond what forward saved, where one node over all the logits holds all of it; measured on torch's
    # engine, against memory.logits_bytes (the weight's and the hidden state's gradients, small here, aside)
    args = ModelArgs(dim=8, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=2048, ffn_hidden=16, max_seq_len=256)
    plan = Plan(micro_batch=1)
    small = (args.vocab_size * args.dim + 256 * args.dim) * 2 * 2
    for chunks in (1, 8):
        training = dataclasses.replace(_training("torchtune", seq_len=256, global_batch=1), loss_chunks=chunks,
                                       ce_kernel=True)
        expected = logits_bytes(args, training, plan)
        assert expected == 256 * 2048 * 2 / chunks
        assert _chunk_loss_backward_peak(chunks, 256, 2048, args.dim) == pytest.approx(expected, abs=small)
        # eager (no compile): each chunk's torch cross-entropy over its fp32 upcast, its log-probabilities saved
        eager = dataclasses.replace(training, ce_kernel=False)
        expected = logits_bytes(args, eager, plan)
        assert expected == 256 * 2048 * 4 * 2 / chunks
        assert _chunk_loss_backward_peak(chunks, 256, 2048, args.dim, eager=True) == pytest.approx(expected,
                                                                                                  abs=small)


def _te_offload_resident(layers: int, offloaded: int) -> int:
    """The most blocks' activations on the device over a forward and backward under Transformer Engine's
    DefaultOffloadSynchronizer (transformer_engine/pytorch/cpu_offload.py, _init_offload_synchronization_dicts),
    written out: blocks 0..k-1 are offloaded, block i's device copy is released when block L - k + i's forward
    starts and reloaded when block L - 1 - k + i's backward starts; a block's activations are freed by its backward."""
    release_at = {layers - offloaded + i: i for i in range(offloaded)}
    reload_at = {layers - 1 - offloaded + i: i for i in range(offloaded)}
    resident, most = set(), 0
    for j in range(layers):  # forward
        if j in release_at:
            resident.discard(release_at[j])
        resident.add(j)
        most = max(most, len(resident))
    for j in reversed(range(layers)):  # backward
        if j in reload_at:
            resident.add(reload_at[j])
        most = max(most, len(resident))
        resident.discard(j)
    return most


def test_megatron_cpu_offloading_keeps_the_blocks_not_offloaded_and_prices_the_copies():
    # Megatron-Core's cpu_offloading (Training.offload_layers: cpu_offloading_num_layers, the GB200 recipes of
    # Megatron Bridge): the saved tensors of the first k blocks go to the host and come back, and Transformer
    # Engine's synchroniser keeps at most L - k blocks' on the device (its schedule written out above); the copies
    # run behind the forward and the backward, exposed past them; Megatron-Core refuses it beside a pipeline, beside
    # recompute and for every block (transformer_config.py), and it is Megatron-Core's alone
    from shardwise.planner.memory import offload_kept_share
    from shardwise.planner.plan import engine_error

    for layers, k in ((80, 40), (126, 95), (32, 1), (8, 7)):
        assert _te_offload_resident(layers, k) == layers - k
        training = dataclasses.replace(_training("megatron-core"), offload_layers=k)
        assert offload_kept_share(training, Plan(activation_checkpoint="none"), layers) * layers == layers - k
    args, cluster = preset("llama3-8b"), Cluster(accelerator("gb200"), 8)
    plan = Plan(dp_shard=8, zero_stage=3, micro_batch=2, activation_checkpoint="none")
    mc = _training("megatron-core", seq_len=8192, global_batch=16, precision="fp8")
    on, off = (evaluate(args, dataclasses.replace(mc, offload_layers=k), plan, cluster) for k in (16, 0))
    kept = 16 * layer_activation_bytes(args, mc, plan)
    assert off.memory["activations"] - on.memory["activations"] == pytest.approx(kept, rel=1e-6)
    assert on.time.step_time_s == pytest.approx(off.time.step_time_s, rel=1e-6)  # 29 GiB each way at 225 GB/s: hidden
    from shardwise.planner.memory import host_bytes

    assert host_bytes(args, dataclasses.replace(mc, offload_layers=16), plan) == pytest.approx(kept)  # on the Grace
    # a host link too slow for the copies: the step grows by what they outlast the forward and the backward by
    slow = Cluster(dataclasses.replace(accelerator("gb200"), host_bw=10e9, comm_overlap=1.0), 8)
    offloaded = dataclasses.replace(mc, offload_layers=16)
    late, early = evaluate(args, offloaded, plan, slow), evaluate(args, mc, plan, slow)
    cost = stage_cost(args, offloaded, plan, slow)
    copies = kept / 10e9
    assert copies > cost.backward_input + cost.backward_weight > cost.forward
    assert late.time.step_time_s - early.time.step_time_s == pytest.approx(
        plan.grad_accum * ((copies - cost.forward) + (copies - cost.backward_input - cost.backward_weight)), rel=1e-6)
    # the search prices its floor with the blocks offloaded and no recompute (the only policy Megatron-Core runs
    # beside it): a board that fits only that finds it
    from shardwise.planner.search import search

    big = preset("llama3-70b")  # (79 of its 80 blocks offloaded at micro-batch 1: 35.2 GiB; full recompute: 46.0)
    small = Cluster(dataclasses.replace(accelerator("gb200"), memory_bytes=40 * GiB), 64, gpus_per_node=64)
    deep = dataclasses.replace(mc, global_batch=128, offload_layers=79)
    found = search(big, deep, small, {"tp": 1, "cp": 1, "pp": 1}, top_k=5)
    best = found.ranked[0]
    assert best.plan.activation_checkpoint == "none" and best.memory["total"] < 40 * GiB
    assert not evaluate(big, dataclasses.replace(deep, offload_layers=0), best.plan, small).fits
    # and on the host: micro-batch 2 offloads 287 GiB of activations, over the Grace's 223.5 GiB a GPU, so every
    # plan ranked fits there too, and the search says what it left out
    assert all(ev.fits for ev in found.ranked) and found.least_host > small.accelerator.host_memory_bytes
    with pytest.raises(PlannerError, match="activation_checkpoint"):
        search(big, deep, small, {"tp": 1, "cp": 1, "pp": 1, "activation_checkpoint": "full"}, top_k=1)
    ac = "parallel.activation_checkpoint"
    for refused, field in ((Plan(pp=2, micro_batch=2, grad_accum=2, activation_checkpoint="none"), "parallel.pp"),
                           (dataclasses.replace(plan, activation_checkpoint="selective"), ac),
                           (dataclasses.replace(plan, activation_checkpoint="full"), ac)):
        error = engine_error(refused, offloaded, args)
        assert error is not None and error.field == field, refused
    error = engine_error(plan, dataclasses.replace(mc, offload_layers=32), args)
    assert error is not None and error.field == "--system offload_layers"
    with pytest.raises(PlannerError, match="offload_layers"):  # before any search
        check_recipe(args, dataclasses.replace(mc, offload_layers=32))
    with pytest.raises(PlannerError, match="offload_layers"):
        dataclasses.replace(_training("torchtitan"), offload_layers=4)


def test_activation_offloading_moves_the_inputs_a_checkpointed_block_saves_through_autograd():
    # torchtune's activation offloading is saved-tensor hooks around the model's forward; under full recompute what
    # they see of a block is its input, which torch's non-reentrant checkpoint saves through autograd (the engine's
    # checkpoint here, as torchtune's checkpoint_wrapper): one b x s x d tensor a block, what layer_activation_bytes
    # counts for full recompute. The planner keeps its forward stash's five on the device (memory.OFFLOAD_STASH),
    # prices the copies behind compute, and refuses offloading without full recompute as torchtune does
    from shardwise.planner.memory import OFFLOAD_STASH, offload_kept_share, stage_memory
    from shardwise.planner.plan import engine_error

    args = preset("debug", dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=256)
    model = build_model(args)
    materialize(model, args, "cpu", 0)
    apply_activation_checkpointing(model, "full")
    inside, inputs, packed = [], [], []

    def enter(module, args):
        inside.append(module)
        inputs.append(args[0])

    for block in model.layers.values():
        block.register_forward_pre_hook(enter)
        block.register_forward_hook(lambda module, args, out: inside.clear())

    def pack(t):
        if inside:
            packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, 256, (2, 32)))
    assert len(inputs) == 4
    # (the engine passes its rotary table, a buffer, to each block: saved as it lies, nothing to offload)
    constant = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved = [t.untyped_storage().data_ptr() for t in packed if t.untyped_storage().data_ptr() not in constant]
    assert saved == [t.untyped_storage().data_ptr() for t in inputs]
    training = dataclasses.replace(_training("torchtune", seq_len=32, global_batch=2), activation_offload=True)
    full = Plan(micro_batch=2, activation_checkpoint="full")
    assert layer_activation_bytes(args, training, full) == sum(t.numel() for t in inputs) / 4 * 2  # in bf16
    assert offload_kept_share(training, full, 28) == OFFLOAD_STASH / 28 and offload_kept_share(training, full, 4) == 1
    error = engine_error(Plan(micro_batch=2, activation_checkpoint="none"), training, args)
    assert error is not None and error.field == "parallel.activation_checkpoint"
    llama, cluster = preset("llama3.2-3b"), Cluster(accelerator("a100"), 1)
    tune = _training("torchtune", seq_len=4096, global_batch=2)
    on, off = (evaluate(llama, dataclasses.replace(tune, activation_offload=flag), full, cluster) for flag in (1, 0))
    at_the_loss = [stage_memory(llama, dataclasses.replace(tune, activation_offload=flag), full, 0,
                                "loss_backward")["activations"] for flag in (1, 0)]
    kept = 28 * layer_activation_bytes(llama, tune, full)
    assert at_the_loss[1] - at_the_loss[0] == pytest.approx(kept * (1 - 5 / 28), rel=1e-6)
    assert on.time.step_time_s == pytest.approx(off.time.step_time_s, rel=0.01)  # 1.3 GiB each way, behind compute
    from shardwise.planner.timing import activation_offload_time, stage_cost

    offloaded = dataclasses.replace(tune, activation_offload=True)
    slow = dataclasses.replace(accelerator("a100"), host_bw=1e9)  # copies longer than the compute: exposed
    cost = stage_cost(llama, offloaded, full, Cluster(slow, 1))
    copies = 2 * 28 * layer_activation_bytes(llama, offloaded, full) / 1e9
    assert activation_offload_time(llama, offloaded, full, slow, cost) == pytest.approx(
        copies - slow.comm_overlap * min(copies, cost.compute))
    # under FSDP the late blocks' backward frees only what the device kept: no moment goes below nothing
    sharded = Plan(dp_shard=2, zero_stage=3, micro_batch=1, activation_checkpoint="full")
    offloaded = dataclasses.replace(offloaded, global_batch=2)
    for moment in ("first_block_backward", "second_block_backward", "late_block_backward"):
        items = stage_memory(llama, offloaded, sharded, 0, moment)
        assert min(items.values()) >= 0, (moment, items)


def test_the_optimizer_in_backward_holds_no_gradient_set_and_needs_one_micro_batch():
    # torchtune's optimizer_in_bwd: an optimizer per parameter, stepped from its post-accumulate-grad hook, which
    # then drops the gradient. On torch's engine no gradient is left when backward returns; the planner keeps none
    # as model state (a block's are made in its backward, as without it) and refuses accumulation, as torchtune does
    from shardwise.planner.plan import engine_error

    args = preset("debug", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=256)
    model = build_model(args)
    materialize(model, args, "cpu", 0)
    optimizers = {p: torch.optim.AdamW([p], lr=1e-3) for p in model.parameters()}

    def step(p):
        optimizers[p].step()
        p.grad = None

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    tokens = torch.randint(0, 256, (2, 16))
    before = [p.detach().clone() for p in model.parameters()]
    engine_loss(model, tokens, tokens).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # every one stepped
    tune = _training("torchtune", global_batch=1)
    training = dataclasses.replace(tune, optimizer_in_backward=True)
    plan = Plan(micro_batch=1, activation_checkpoint="full")
    ev = evaluate(preset("llama3.2-3b"), training, plan, Cluster(accelerator("a100"), 1))
    assert ev.memory.get("grads", 0.0) == 0.0
    with_grads = evaluate(preset("llama3.2-3b"), tune, plan, Cluster(accelerator("a100"), 1))
    assert with_grads.memory["total"] > ev.memory["total"]
    error = engine_error(dataclasses.replace(plan, grad_accum=2), training, args)
    assert error is not None and error.field == "parallel.grad_accum"


def test_torchtune_has_no_op_level_selective_checkpointing_and_a_replay_never_makes_negative_bytes(capsys, tmp_path):
    # torchtune's ac_mode "selective" wraps every k-th layer whole (training/activations.py): the preset's selective
    # is "none", so the planner neither offers op-level selective recompute for it nor prices one it is given
    from shardwise.planner.plan import engine_error
    from shardwise.planner.search import plan_space

    args = preset("llama3.2-3b")
    tune = _training("torchtune", global_batch=2)
    assert tune.selective == "none"
    error = engine_error(Plan(micro_batch=1, grad_accum=2, activation_checkpoint="selective"), tune, args)
    assert error is not None and error.field == "parallel.activation_checkpoint" and "op-level" in error.problem
    assert engine_error(Plan(micro_batch=1, grad_accum=2, activation_checkpoint="full"), tune, args) is None
    walked = {p.activation_checkpoint for p in plan_space(args, tune, Cluster(accelerator("a100"), 1))}
    assert walked == {"none", "full"}
    with pytest.raises(PlannerError, match="op-level"):  # evaluate, which does not ask engine_error, refuses too
        evaluate(args, tune, Plan(micro_batch=1, grad_accum=2, activation_checkpoint="selective"),
                 Cluster(accelerator("a100"), 1))
    argv = ["--model", "llama3.2-3b", "--gpus", "1", "--gpu", "a100", "--seq-len", "4096", "--global-batch", "2",
            "--system", "torchtune"]
    assert run_plan(_ns(*argv, "--plan", "activation_checkpoint=selective")) == 2
    err = capsys.readouterr().err
    assert "activation_checkpoint" in err and "op-level" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "tune-4.toml").write_text('base = "torchtune"\nloss_chunks = 4\n')  # summarised field by field
    assert run_plan(_ns(*argv[:-2], "--system", str(tmp_path / "tune-4.toml"), "--top-k", "1")) == 0
    assert "no op-level selective checkpointing" in capsys.readouterr().out
    # a system file that gives torchtune a policy saving every matmul output: under LoRA it keeps a frozen
    # linear's output, which no backward reads, so it keeps more than no recompute; its replay still rebuilds
    # what it did not keep of the no-recompute set (the norms' tensors, the rotated q and k, SiLU's output and the
    # gate product), counted here by name (the difference of the two totals, negative, was counted once)
    (tmp_path / "tune-sac.toml").write_text('base = "torchtune"\nselective = "matmuls"\n')
    sac = Training(**{"seq_len": 4096, "global_batch": 2, "lora_rank": 16,
                      **resolve_system(str(tmp_path / "tune-sac.toml")).training_fields()})
    selective = Plan(micro_batch=1, grad_accum=2, activation_checkpoint="selective")
    kept = layer_activation_bytes(args, sac, selective)
    assert kept > layer_activation_bytes(args, sac, selective, "none")
    tokens = 4096
    by_name = {t.name: term_bytes(t, args, sac, selective) for t in block_terms(args, sac, "none", 0)}
    # torchtune's composite RMSNorm saves an fp32 upcast of its bf16 input: the kept block input is not it
    rebuilt = ["attention_norm_input", "attention_norm_rstd", "attention_norm_output", "q_rotated", "k_rotated",
               "ffn_norm_input", "ffn_norm_rstd", "ffn_norm_output", "silu_out", "swiglu_out"]
    both = {"v", "sdpa_out", "sdpa_lse", "w1_out", "w3_out",  # kept by the policy too
            *(f"{t}_lora_a_out" for t in ("wq", "wk", "wv", "wo", "w1", "w3", "w2"))}  # x A^T, B's input
    assert set(by_name) - set(rebuilt) == both
    assert block_backward_bytes(args, sac, selective)["recomputed"] == pytest.approx(
        tokens * sum(by_name[n] for n in rebuilt), rel=1e-12)


def test_torchtitans_selective_replay_rebuilds_what_its_policy_did_not_keep_under_sequence_parallelism():
    """torchtitan's op-level policy under tp 2 with sequence parallelism keeps the block input, wq's, wv's, w1's and
    w2's outputs, the attention's output and log-sum-exp, and the two reduce-scatters' outputs; its replay rebuilds
    the rest of what the block keeps without recompute (by name: the norms' tensors but the input, the rotated q
    and k, SiLU's and w3's outputs and the gate product). v is a view of wv's output; wq's output, w2's and the
    reduce-scatters' are kept beyond that set and rebuild nothing (they were once subtracted from the replay)."""
    from shardwise.planner.memory import block_backward_bytes, block_terms, term_bytes

    args = preset("llama3-8b")
    titan = _training("torchtitan")
    plan = Plan(tp=2, sequence_parallel=True, micro_batch=1, grad_accum=8, activation_checkpoint="selective")
    none = {t.name: term_bytes(t, args, titan, plan) for t in block_terms(args, titan, "none", 0)}
    rebuilt = ["attention_norm_rstd", "attention_norm_output", "q_rotated", "k_rotated", "ffn_norm_input",
               "ffn_norm_rstd", "ffn_norm_output", "silu_out", "w3_out", "swiglu_out"]
    assert set(none) - set(rebuilt) == {"attention_norm_input", "v", "sdpa_out", "sdpa_lse", "w1_out"}
    assert block_backward_bytes(args, titan, plan)["recomputed"] == pytest.approx(
        4096 * sum(none[n] for n in rebuilt), rel=1e-12)


def test_a_compiled_block_dequantises_an_nf4_weight_in_one_fused_pass_and_keeps_it_for_backward():
    # torchtune compiles each layer with QLoRA's NF4 base in it (and shardwise's train.compile does): dynamo traces
    # through torchao's NF4Tensor and inductor fuses the whole dequantisation (shifts, masks, the code-table lookup,
    # the two scalings) into one kernel ahead of the matmul, read in the generated code here; the backward runs its
    # matmul alone, on the dequantised weight the partitioner saved from forward (eager torchao saves the NF4 weight
    # and dequantises again). The planner prices one forward pass, the codes and constants read and the weight
    # written once (eager: 77 bytes a weight, counted on the engine's block), none in backward, and keeps the
    # dequantised weights of a block for its backward
    from torch._inductor.utils import run_and_get_code

    from shardwise import nf4
    from shardwise.planner.memory import adapted_base_params
    from shardwise.planner.timing import qlora_dequant
    from shardwise.planner.workload import QLORA_BITS

    weight = torch.nn.Parameter(nf4.quantize(torch.randn(512, 1024, dtype=torch.bfloat16)), requires_grad=False)
    x = torch.randn(16, 1024, dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: torch.nn.functional.linear(x, weight))
    saved = []

    def run():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = compiled(x)
        out.backward(torch.ones_like(out))
        return out

    out, (forward, backward) = run_and_get_code(run)
    kernels = [[line for line in code.splitlines() if "async_compile.cpp" in line] for code in (forward, backward)]
    assert [len(k) for k in kernels] == [1, 0] and forward.count("extern_kernels.mm") == 1, forward
    assert backward.count("extern_kernels.mm") == 1, backward
    kept = [t for t in saved if type(t) is torch.Tensor and t.shape == (512, 1024)]
    assert len(kept) == 1 and kept[0].dtype == torch.bfloat16  # the plain dequantised weight, not the NF4 one
    assert torch.allclose(out, torch.nn.functional.linear(x, weight.get_original_weight()), atol=0.5)
    args, acc = preset("llama3.2-3b"), accelerator("a100")
    qlora = _training("torchtune", lora_rank=64, qlora=True, lora_targets=("wq", "wv", "wo", "w1", "w3", "w2"))
    eager, fused = (qlora_dequant(args, dataclasses.replace(qlora, compile=c), Plan(), acc, 28) for c in (0, 1))
    weights = 28 * adapted_base_params(args, qlora, 1)
    assert fused[:2] == (pytest.approx(weights * (QLORA_BITS / 8 + 2) / (acc.mem_bandwidth * acc.bandwidth_efficiency)),
                         0.0)
    assert eager[0] > 20 * fused[0]
    plan = Plan(micro_batch=1)
    kept_by_planner = (layer_activation_bytes(args, dataclasses.replace(qlora, compile=True), plan)
                       - layer_activation_bytes(args, dataclasses.replace(qlora, compile=True, qlora=False), plan))
    assert kept_by_planner == adapted_base_params(args, qlora, 1) * 2
    # under a selective checkpoint that recomputes all but the matmuls (the engine's policy), the partitioner
    # rebuilds the weight from its codes instead of keeping it
    from shardwise.activation_checkpoint import _selective_context

    saved.clear()
    torch._dynamo.reset()
    checkpointed = torch.compile(lambda x: torch.utils.checkpoint.checkpoint(
        torch.nn.functional.linear, x, weight, use_reentrant=False, context_fn=_selective_context))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        checkpointed(x).sum().backward()
    assert not [t for t in saved if type(t) is torch.Tensor and t.shape == (512, 1024)]
    # (torchtune itself has no op-level selective checkpointing: the engine's policy, on torchtune's recipe)
    selective = Plan(micro_batch=1, activation_checkpoint="selective")
    sac = dataclasses.replace(qlora, selective="matmuls")
    assert (layer_activation_bytes(args, dataclasses.replace(sac, compile=True), selective)
            == layer_activation_bytes(args, dataclasses.replace(sac, compile=True, qlora=False), selective))


def test_the_gb200_is_the_nvl72_datasheet_per_gpu_and_found_before_the_b200(monkeypatch):
    # NVIDIA's GB200 NVL72 datasheet gives a rack of 72 GPUs with sparsity: 720 PF FP8, 360 PF BF16, 576 TB/s of
    # HBM3e, 130 TB/s of NVLink; nvidia-smi prints 189471 MiB on one. Its driver name contains "B200", so it is
    # matched first. Its matmul efficiency scales Bekman's MAMF table as every GPU's does: 1822.0 of 2500 TFLOP/s
    # (72.9%) against the A100's 271.2 of 312 (86.9%), times the A100's 0.70; a matmul rate 4% above the B200's
    # 1745.0, where the datasheet peaks differ by 11%
    from shardwise.hardware import detect_accelerator

    gb200, b200 = accelerator("gb200"), accelerator("b200")
    assert gb200.peak_flops["bf16"] == pytest.approx(360e15 / 72 / 2)
    assert gb200.peak_flops["fp8"] == pytest.approx(720e15 / 72 / 2)
    assert gb200.mem_bandwidth == pytest.approx(576e12 / 72)
    assert gb200.intra_node_bw == pytest.approx(130e12 / 72 / 2, rel=0.01)
    assert gb200.memory_bytes / GiB == pytest.approx(189471 / 1024, abs=0.01)
    assert gb200.matmul_efficiency == pytest.approx(0.70 * (1822.0 / 2500) / (271.2 / 312), abs=1e-3)
    rate = gb200.matmul_efficiency * gb200.peak_flops["bf16"] / (b200.matmul_efficiency * b200.peak_flops["bf16"])
    assert rate == pytest.approx(1822.0 / 1745.0, rel=0.01) and gb200.intra_node_fabric == "nvlink"
    for label, key in (("NVIDIA GB200", "gb200"), ("NVIDIA B200", "b200")):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, label=label: label)
        assert detect_accelerator(torch.device("cuda", 0)) == key


def test_the_fine_tuning_gpus_are_in_the_catalogue_and_found_by_their_driver_names(monkeypatch):
    # torchtune's tables ran on an RTX 4090 and an RTX A6000, and the clouds rent 8-GPU L40S servers: each is in the
    # catalogue (hardware.CATALOGUE, datasheet figures) and recognised by the name the driver gives it, the L40S
    # before the L4 its name contains (which it was taken for before)
    from shardwise.hardware import detect_accelerator

    names = {"NVIDIA GeForce RTX 4090": "rtx-4090", "NVIDIA RTX A6000": "rtx-a6000", "NVIDIA L40S": "l40s",
             "NVIDIA L4": "l4", "NVIDIA H100 80GB HBM3": "h100"}
    for label, key in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, label=label: label)
        assert detect_accelerator(torch.device("cuda", 0)) == key
    for key in ("rtx-4090", "rtx-a6000", "l40s"):
        acc = accelerator(key)
        assert acc.intra_node_fabric == "pcie" and acc.source
    assert accelerator("4090").memory_bytes / GiB == pytest.approx(24564 / 1024, abs=0.01)
    assert "fp8" not in accelerator("a6000").peak_flops  # Ampere: no float8
    # QLoRA of Llama 3.2 3B fits a 4090 as torchtune runs it; a full fine-tune with mixed-precision AdamW does not
    args, cluster = preset("llama3.2-3b"), Cluster(accelerator("rtx-4090"), 1)
    plan = Plan(micro_batch=1, activation_checkpoint="full")
    qlora = _training("torchtune", seq_len=2048, global_batch=1, lora_rank=16, qlora=True)
    assert evaluate(args, qlora, plan, cluster).memory["total"] < accelerator("rtx-4090").memory_bytes
    full = _training("torchtitan", seq_len=2048, global_batch=1)
    assert evaluate(args, full, plan, cluster).memory["total"] > accelerator("rtx-4090").memory_bytes


# ---------------------------------------------------------------------------------------------------
# The parallelisms a system has: the planner offers no plan the system cannot run


PARALLEL_DEFAULTS = {"pp_schedules": Training.pp_schedules, "pp_zero_max": Training.pp_zero_max,
                     "zero_stages": (0, 1, 2, 3), "ddp_alone": False, "hsdp_stages": (2, 3), "offload_stages": (2, 3),
                     "tensor_parallel": True, "context_parallel": True, "expert_parallel": True}


def _runs_on(plan: Plan, system: System) -> bool:
    """Whether `system` runs the plan, written out system by system from the sources its preset cites (not from
    the fields under test). A plan's data parallelism: DDP is ZeRO-0 over dp_replicate x cp > 1, ZeRO-1 shards the
    optimizer, FSDP is ZeRO-2/3 over dp_shard x cp, hybrid sharding is FSDP with dp_replicate > 1."""
    dp_ranks, shard = plan.dp * plan.cp, plan.dp_shard * plan.cp
    ddp = plan.zero_stage == 0 and dp_ranks > 1
    hybrid = plan.zero_stage >= 2 and plan.dp_replicate > 1
    full = plan.offload == "full"
    pipeline = plan.pp > 1
    name = system.name
    if plan.ep > 1 and name in ("torchtune", "megatron-lm-2021", "deepspeed-2021"):  # no expert parallelism then
        return False
    if name == "torchtitan":  # apply_ddp alone ('DDP has not supported > 1D parallelism'), apply_fsdp: no ZeRO-1
        return plan.zero_stage != 1 and not (ddp and plan.tp * plan.pp * plan.cp > 1)
    assert not (plan.zero_stage >= 2 and shard == 1 and not full)  # (FSDP over one rank is offload's alone)
    if name == "megatron-core":  # two schedules; optimizer-only host offload
        return not full and (not pipeline or plan.pp_schedule in ("1f1b", "interleaved-1f1b"))
    if name == "megatron-lm-2021":  # DDP or the distributed optimizer; no cp, no offload
        return plan.zero_stage <= 1 and plan.cp == 1 and not full and (
            not pipeline or plan.pp_schedule in ("1f1b", "interleaved-1f1b"))
    if name == "llm-foundry":  # FSDP1 (NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD) and nothing else
        return plan.tp == plan.pp == plan.cp == 1 and plan.zero_stage != 1
    if name == "torchtune":  # FSDP2 over every data-parallel rank of v0.4-v0.6.1
        return plan.tp == plan.pp == plan.cp == 1 and plan.dp_replicate == 1 and (
            plan.zero_stage >= 2 or dp_ranks == 1 and plan.zero_stage == 0)
    if name in ("deepspeed", "deepspeed-2021"):  # its 1F1B engine beside ZeRO <= 1; Ulysses is not ring cp;
        # the weights offloaded at ZeRO-3 only (offload_param; cpu_offload_params in v0.3.13)
        ok = plan.cp == 1 and (not pipeline or plan.pp_schedule == "1f1b" and plan.zero_stage <= 1) and (
            not full or plan.zero_stage == 3)
        if name == "deepspeed":  # MiCS (2023) replicates ZeRO-3 shards
            return ok and (not hybrid or plan.zero_stage == 3)
        return ok and not hybrid  # 2021: no MiCS
    assert name == "shardwise"
    return True


@pytest.mark.parametrize("model", ["llama3-8b", "mixtral-8x7b"])
@pytest.mark.parametrize("name", sorted(SYSTEMS))
def test_a_system_is_offered_exactly_the_plans_it_can_run(name, model):
    """The walk under a system is the walk with every parallelism, less the plans the system lacks: nothing it
    cannot run is offered, and nothing it can run is dropped (dense and with experts, with and without offload)."""
    from shardwise.planner.search import plan_space

    args = dataclasses.replace(preset(model), n_layers=8)
    cluster = Cluster(accelerator("h100"), 16)
    system = SYSTEMS[name]
    fields = {**system.training_fields(), "fused_attention": True}  # (megatron-lm-2021: cp needs a fused kernel)
    training = Training(seq_len=4096, global_batch=16, **fields)
    every = Training(seq_len=4096, global_batch=16, **{**fields, **PARALLEL_DEFAULTS})

    def key(p: Plan) -> tuple:
        return dataclasses.astuple(p)

    walks = {}
    for offload in ("none", "full"):
        offered = {key(p) for p in plan_space(args, training, cluster, offload=offload)}
        possible = {key(p) for p in plan_space(args, every, cluster, offload=offload) if _runs_on(p, system)}
        assert offered == possible
        walks[offload] = offered, sum(1 for _ in plan_space(args, every, cluster, offload=offload))
    assert walks["none"][0]  # (something runs)
    if name != "shardwise":  # each lacks something the full walk has, with or without offload
        assert any(len(offered) < everything for offered, everything in walks.values())


@pytest.mark.parametrize("name, plan, key", [
    ("megatron-core", "pp=2,pp_schedule=zero-bubble", "--plan pp_schedule"),
    ("llm-foundry", "tp=2", "--plan tp"), ("llm-foundry", "pp=2", "--plan pp"), ("llm-foundry", "cp=2", "--plan cp"),
    ("deepspeed", "pp=2,zero_stage=3", "--plan zero_stage"), ("deepspeed", "cp=2", "--plan cp"),
    ("deepspeed", "pp=2,pp_schedule=interleaved-1f1b", "--plan pp_schedule"),
    ("torchtune", "pp=2", "--plan pp"), ("torchtitan", "dp_replicate=16,zero_stage=1", "--plan zero_stage"),
    # a pipeline asked for without pp, or sharding that ZeRO <= 1 beside a pipeline cannot do
    ("deepspeed", "pp_schedule=1f1b,zero_stage=2", "--plan zero_stage"),
    ("deepspeed", "pp_microbatches=4,zero_stage=3", "--plan zero_stage"),
    ("deepspeed", "pp=2,dp_shard=8", "--plan dp_shard"), ("deepspeed", "pp=2,offload=full", "--plan offload"),
    ("deepspeed", "pp=2,virtual_stages=2", "--plan virtual_stages"),
    ("llm-foundry", "pp_microbatches=2", "--plan pp_microbatches"),
    ("llm-foundry", "virtual_stages=2", "--plan virtual_stages"),
    ("llm-foundry", "sequence_parallel=true", "--plan sequence_parallel"), ("llm-foundry", "tp=3", "--plan tp"),
    # DDP beside cp, hybrid sharding, host offload, schedules without a pipeline
    ("torchtitan", "cp=2,zero_stage=0", "--plan zero_stage"), ("torchtune", "dp_replicate=2", "--plan dp_replicate"),
    ("deepspeed", "dp_replicate=2,dp_shard=8,zero_stage=2", "--plan dp_replicate"),
    ("megatron-core", "offload=full", "--plan offload"),
    ("megatron-lm-2021", "tp=2,pp=8,offload=full", "--plan offload"),
    ("shardwise", "pp=1,pp_schedule=1f1b", "--plan pp_schedule"),
    ("torchtitan", "dp_replicate=8,zero_stage=0", "--plan zero_stage"),
    ("torchtune", "dp_shard=2", "--plan dp_shard"), ("deepspeed", "pp=2,dp=4,dp_replicate=1", "--plan dp_replicate"),
    ("deepspeed", "offload=full,zero_stage=2", "--plan offload"),
    ("torchtitan", "dp_replicate=2,pp=8", "--plan zero_stage"),  # (the completed plan's: DDP beside a pipeline)
    # splits the other keys leave: dp_shard=2 beside DeepSpeed's pipeline, replicas inferred, DDP beside a dp < world
    ("deepspeed", "pp=2,tp=2,dp_replicate=2", "--plan dp_replicate"),
    ("deepspeed-2021", "dp_shard=4,tp=2,pp=1", "--plan dp_shard"),
    ("torchtitan", "zero_stage=0,dp=8", "--plan zero_stage"),
    ("megatron-core", "pp_schedule=1f1b,virtual_stages=3", "--plan virtual_stages"),
    ("torchtune", "dp_replicate=16,zero_stage=0", "--plan zero_stage"),
    ("megatron-lm-2021", "dp_shard=16,zero_stage=3", "--plan zero_stage")])
def test_plan_asking_for_what_the_system_lacks_is_refused(name, plan, key, capsys):
    argv = ["--model", "llama3-8b", "--gpus", "16", "--seq-len", "4096", "--global-batch", "32", "--system", name,
            "--plan", plan]
    assert run_plan(_ns(*argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"shardwise: error: {key}:") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("name, plan, fix", [("torchtitan", "dp_replicate=16,zero_stage=1", "use zero_stage=0"),
                                             ("llm-foundry", "dp_replicate=16,zero_stage=1", "use zero_stage=0"),
                                             ("megatron-lm-2021", "dp_shard=16,zero_stage=3",
                                              "use dp_replicate with zero_stage=1"),
                                             ("torchtune", "zero_stage=0", "use zero_stage=3 or another of those"),
                                             ("torchtitan", "dp_replicate=2,tp=8,zero_stage=1",
                                              "use dp_shard (not dp_replicate) with zero_stage=3"),
                                             ("torchtitan", "cp=2,dp_replicate=8,zero_stage=1",
                                              "use zero_stage=3 or another of those")])
def test_a_refused_zero_stage_gets_one_that_fits_the_split(name, plan, fix, capsys):
    argv = ["--model", "llama3-8b", "--gpus", "16", "--seq-len", "4096", "--global-batch", "32", "--system", name,
            "--plan", plan]
    assert run_plan(_ns(*argv)) == 2
    assert capsys.readouterr().err.rstrip().endswith(f"; fix: {fix}")


def test_what_a_system_lacks_ends_its_line(capsys):
    argv = ["--model", "llama3-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "16", "--top-k", "1"]
    lines = {}
    for name in ("llm-foundry", "deepspeed", "megatron-core", "torchtitan"):
        assert run_plan(_ns(*argv, "--system", name)) == 0
        lines[name] = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("system:"))
    assert lines["llm-foundry"].endswith("; no tensor parallelism; no context parallelism; no pipeline parallelism; "
                                         "ZeRO-0, 2, 3 over data-parallel ranks")
    assert lines["deepspeed"].endswith("; no context parallelism; pipeline schedule 1f1b only; hybrid sharding at "
                                       "ZeRO-3 only; host offload at ZeRO-3 only; at most ZeRO-1 beside a pipeline")
    assert lines["megatron-core"].endswith("; pipeline schedules 1f1b, interleaved-1f1b; no host offload of the "
                                           "weights")
    assert lines["torchtitan"] == f"system: torchtitan - {SYSTEMS['torchtitan'].summary}; ZeRO-0, 2, 3 over " \
        "data-parallel ranks; DDP only alone"


def test_system_toml_sets_the_parallelisms(tmp_path):
    path = tmp_path / "ds-zb.toml"
    path.write_text('base = "deepspeed"\npp_schedules = ["1f1b", "zero-bubble"]\ncontext_parallel = true\n'
                    'zero_stages = [1, 3]\n')
    system = resolve_system(str(path))
    assert system.pp_schedules == ("1f1b", "zero-bubble") and system.context_parallel and system.pp_zero_max == 1
    assert system.zero_stages == (1, 3)
    training = Training(seq_len=4096, global_batch=8, **system.training_fields())
    hash(training)  # (a TOML array kept as a tuple: the planner memoises on Training)
    assert training.pp_schedules == ("1f1b", "zero-bubble")


@pytest.mark.parametrize("name, plan, field", [
    ("megatron-core", Plan(pp=2, grad_accum=4, pp_schedule="zero-bubble"), "parallel.pp_schedule"),
    ("megatron-core", Plan(pp=2, grad_accum=4, pp_schedule="gpipe"), "parallel.pp_schedule"),
    ("llm-foundry", Plan(tp=2, sequence_parallel=True), "parallel.tp"),
    ("llm-foundry", Plan(pp=2, grad_accum=4), "parallel.pp"),
    ("torchtune", Plan(cp=2, dp_shard=1, zero_stage=0), "parallel.cp"),
    ("torchtune", Plan(dp_replicate=2, zero_stage=0), "parallel.zero_stage"),
    ("torchtitan", Plan(dp_replicate=2, zero_stage=1), "parallel.zero_stage"),
    ("deepspeed", Plan(pp=2, grad_accum=4, dp_shard=2, zero_stage=2), "parallel.zero_stage"),
    ("deepspeed", Plan(cp=2, dp_shard=2, zero_stage=3), "parallel.cp"),
    ("megatron-lm-2021", Plan(dp_shard=2, zero_stage=3), "parallel.zero_stage"),
    ("megatron-lm-2021", Plan(tp=2, zero_stage=2, offload="full"), "parallel.offload"),  # (no host offload in 2021)
    ("megatron-lm-2021", Plan(tp=2, zero_stage=2), "parallel.zero_stage"),  # (ZeRO-2 with no data parallelism)
    ("torchtitan", Plan(tp=2, dp_replicate=2, zero_stage=0), "parallel.zero_stage"),  # DDP beside tp
    ("torchtune", Plan(dp_replicate=2, dp_shard=2, zero_stage=3), "parallel.dp_replicate"),
    ("deepspeed", Plan(dp_replicate=2, dp_shard=2, zero_stage=2), "parallel.dp_replicate"),
    ("megatron-core", Plan(dp_shard=2, zero_stage=3, offload="full"), "parallel.offload")])
def test_engine_error_names_what_the_system_lacks(name, plan, field):
    from shardwise.planner.plan import engine_error

    args = dataclasses.replace(preset("llama3-8b"), n_layers=8)
    training = _training(name, seq_len=4096)
    error = engine_error(plan, training, args)
    assert error is not None and error.field == field and name in error.problem
    # the same plan where every parallelism is there: only the system's refusal went
    assert engine_error(plan, dataclasses.replace(training, **PARALLEL_DEFAULTS), args) is None


@pytest.mark.parametrize("name", ["llm-foundry", "deepspeed", "torchtune"])
def test_the_explanation_weighs_only_what_the_system_runs(name):
    """The knobs' reasons ('tp=2: +5% step time', 'pp=2: out of memory') come from every plan the search sized,
    and from its memory floors: a system without tp, cp or a pipeline has none of those to weigh."""
    from shardwise.planner.search import search

    args = preset("llama3-70b")
    training = _training(name, seq_len=4096, global_batch=64)
    result = search(args, training, Cluster(accelerator("h100"), 32), top_k=1)
    assert result.ranked
    seen = set(result.best_by_knob) | set(result.min_memory_by_knob)
    lacks = {("tp", v) for v in (2, 4, 8)} if not training.tensor_parallel else set()
    lacks |= {("cp", v) for v in (2, 4, 8, 16)} if not training.context_parallel else set()
    lacks |= {("pp", v) for v in (2, 4, 8, 16, 32)} if not training.pp_schedules else set()
    if training.pp_schedules:  # (without a pipeline, a plan's pp_schedule is the unused default)
        lacks |= {("pp_schedule", s) for s in PARALLEL_DEFAULTS["pp_schedules"] if s not in training.pp_schedules}
    assert lacks and not seen & lacks
    assert any(k == "zero_stage" for k, _ in seen)


def test_a_system_file_narrows_or_widens_the_walk(tmp_path):
    from shardwise.planner.search import plan_space

    args = dataclasses.replace(preset("llama3-8b"), n_layers=8)
    cluster = Cluster(accelerator("h100"), 16)
    plans = {}
    for stem, text in (("ds", 'base = "deepspeed"\n'), ("ds-no-pp", 'base = "deepspeed"\npp_schedules = []\n'),
                       ("ds-zero3-pp", 'base = "deepspeed"\npp_zero_max = 3\n')):
        path = tmp_path / f"{stem}.toml"
        path.write_text(text)
        training = Training(seq_len=4096, global_batch=16, **resolve_system(str(path)).training_fields())
        plans[stem] = list(plan_space(args, training, cluster))
    assert not any(p.pp > 1 for p in plans["ds-no-pp"]) and any(p.pp > 1 for p in plans["ds"])
    assert max(p.zero_stage for p in plans["ds"] if p.pp > 1) == 1
    assert max(p.zero_stage for p in plans["ds-zero3-pp"] if p.pp > 1) == 3


def test_a_pipeline_asked_for_is_not_reported_without_one(capsys):
    """Nothing fits a 70B on 8 GPUs without recompute: the given plan is reported anyway, completed from --plan's
    keys. A schedule with no pp would have completed to pp=1, a plan with no pipeline at all."""
    argv = ["--model", "llama3-70b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "16"]
    assert run_plan(_ns(*argv, "--plan", "pp_schedule=1f1b,activation_checkpoint=none")) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardwise: error: --plan pp: pp_schedule=1f1b asks for a pipeline") and \
        len(err.strip().splitlines()) == 1
    assert run_plan(_ns(*argv, "--plan", "pp=8,pp_schedule=1f1b,activation_checkpoint=none")) == 1  # (reported: OOM)
    assert re.search(r"^1 +1 \(1x1\) +1 +8 +1 +0 +1 +16 +none +1f1b ", capsys.readouterr().out, re.M)


@pytest.mark.parametrize("name", ["torchtune", "megatron-lm-2021", "deepspeed-2021", "megatron-core"])
def test_experts_are_split_only_where_the_system_splits_them(name, capsys):
    """torchtune's releases had no mixture of experts (its first, Llama 4, splits experts by tensor parallelism),
    Megatron-LM's came with Megatron-Core, DeepSpeed-MoE after v0.3.13: ep is neither offered nor accepted there."""
    from shardwise.planner.search import plan_space

    args = dataclasses.replace(preset("mixtral-8x7b"), n_layers=4)
    training = Training(seq_len=4096, global_batch=16, **{**SYSTEMS[name].training_fields(), "fused_attention": True})
    eps = {p.ep for p in plan_space(args, training, Cluster(accelerator("h100"), 16))}
    argv = ["--model", "mixtral-8x7b", "--gpus", "16", "--seq-len", "4096", "--global-batch", "32", "--system", name,
            "--plan", "ep=8,dp_shard=16,zero_stage=3"]
    if name == "megatron-core":
        assert eps > {1}
        return
    assert eps == {1}
    assert run_plan(_ns(*argv)) == 2
    assert capsys.readouterr().err.startswith("shardwise: error: --plan ep: ep=8, and " + name)


def test_a_plan_that_does_not_fit_is_reported_as_the_system_would_run_it(capsys):
    """Nothing fits: the given keys are completed to the least-memory plan and reported. For a system without DDP
    (torchtune's FSDP2) that is ZeRO-3 over the data-parallel ranks, not the engine's default ZeRO-0."""
    argv = ["--model", "llama3-8b", "--gpus", "2", "--seq-len", "4096", "--global-batch", "32", "--system",
            "torchtune", "--plan", "micro_batch=16,activation_checkpoint=none"]
    assert run_plan(_ns(*argv)) == 1
    assert re.search(r"^1 +2 \(1x2\) +1 +1 +1 +3 +16 ", capsys.readouterr().out, re.M)


def test_reserved_memory_is_the_caching_allocators_with_fsdp2s_gradients(capsys, tmp_path):
    # What torch's max_memory_reserved reads (torchtitan's and Bekman's published peaks): the planner's moments
    # without its fixed overhead (the CUDA context and NCCL's buffers, which torch's caching allocator does not
    # hold), and under FSDP2 with the gradients it reduces, which it makes in a stream of its own (foreach_reduce)
    # where the allocator keeps them, out of the next forward's reach, after zero_grad frees them. By hand for
    # Llama 3 8B on 8 H100s, the peak at the loss's backward (no gradient yet).
    args = preset("llama3-8b")
    cluster = Cluster(accelerator("h100"), 8)
    plan = Plan(dp_shard=8, zero_stage=3, micro_batch=1, grad_accum=1, activation_checkpoint="selective")
    titan = _training("torchtitan", seq_len=8192, global_batch=8)
    ev = evaluate(args, titan, plan, cluster)
    assert ev.memory["grads"] == 0.0 and ev.memory["fixed_overhead"] == GiB
    shards = 4 * num_params(args) / 8  # fp32 gradients, every parameter sharded over the 8 ranks
    reserved = reserved_bytes(args, titan, plan, ev.memory_stage)
    # torchtitan launches with expandable segments: its total (the fit) carries no fragmentation allowance, what
    # the allocator holds does
    allowance = 0.1 * sum(ev.memory.get(k, 0.0) for k in ("activations", "backward_and_logits", "fsdp_buffers",
                                                            "ddp_buckets"))
    assert ev.memory["fragmentation"] == 0.0 and allowance > GiB
    assert reserved == pytest.approx(ev.memory["total"] - GiB + shards + allowance, rel=1e-9)
    assert 2.5 * GiB < reserved - ev.memory["total"] - allowance < 3.0 * GiB  # 3.74 GiB of shards less 1 GiB
    # every moment holds the whole pool, the shards made so far among them: where a later moment of the backward
    # holds more than the loss's (a short sequence, the blocks' shards outweighing their saved tensors), it sets it
    short = _training("torchtitan", seq_len=1024, global_batch=8)
    moments = moment_memory(args, short, plan, 0)
    assert 0 < moments["late_block_backward"]["grads"] < shards
    held = {name: sum(items.values()) + 0.1 * sum(items.get(k, 0.0) for k in (
        "activations", "backward_and_logits", "fsdp_buffers", "ddp_buckets")) + shards - items.get("grads", 0.0)
        for name, items in moments.items()}
    assert max(held, key=held.get) != "loss_backward"
    assert reserved_bytes(args, short, plan, 0) == pytest.approx(max(held.values()), rel=1e-9)
    # over 64 ranks the shards are an eighth as large
    wide = Plan(dp_shard=64, zero_stage=3, micro_batch=1, grad_accum=1, activation_checkpoint="selective")
    titan64 = _training("torchtitan", seq_len=8192, global_batch=64)
    ev64 = evaluate(args, titan64, wide, Cluster(accelerator("h100"), 64))
    reserved64 = reserved_bytes(args, titan64, wide, ev64.memory_stage)
    allowance64 = 0.1 * sum(ev64.memory.get(k, 0.0) for k in ("activations", "backward_and_logits", "fsdp_buffers",
                                                                "ddp_buckets"))
    assert reserved64 == pytest.approx(ev64.memory["total"] - GiB + shards / 8 + allowance64, rel=1e-9)
    # shardwise's ZeRO-0/1 is FSDP2's replicate, which reduces over a one-rank reduce-scatter into the same
    # stream: the whole set
    ours = _training("shardwise", seq_len=8192, global_batch=8)
    replicated = Plan(dp_replicate=8, micro_batch=1, grad_accum=1, activation_checkpoint="selective")
    ev = evaluate(args, ours, replicated, cluster)
    assert reserved_bytes(args, ours, replicated, ev.memory_stage) == pytest.approx(
        ev.memory["total"] - GiB + 8 * shards, rel=1e-9)
    # ... at most what the device holds: the allocator releases its cache when an allocation fails
    assert reserved_bytes(args, ours, replicated, 0, limit=70 * GiB) == 70 * GiB
    # a system file keeps its base's replicate, or says it is torch's DDP
    for text, cached in (('base = "shardwise"\n', True), ('base = "shardwise"\nfsdp_replicate = false\n', False)):
        path = tmp_path / "mine.toml"
        path.write_text(text)
        mine = Training(seq_len=8192, global_batch=8, **resolve_system(str(path)).training_fields())
        assert mine.fsdp_replicate is cached
        extra = 8 * shards if cached else 0.0
        assert reserved_bytes(args, mine, replicated, 0) == pytest.approx(
            evaluate(args, mine, replicated, cluster).memory["total"] - GiB + extra, rel=1e-9)
    # outside FSDP (Megatron's buffers, DeepSpeed's ZeRO-3, torchtitan's DDP of the preset's time, torch's
    # DDP-based replicate): the allocator's share alone
    for system, other in (("megatron-core", Plan(dp_replicate=8, zero_stage=1, micro_batch=1, grad_accum=1)),
                          ("deepspeed", plan), ("torchtitan", replicated)):
        training = _training(system, seq_len=8192, global_batch=8)
        ev = evaluate(args, training, other, cluster)
        held = 0.1 * sum(ev.memory.get(k, 0.0) for k in ("activations", "backward_and_logits", "fsdp_buffers",
                                                          "ddp_buckets")) if training.expandable_segments else 0.0
        assert reserved_bytes(args, training, other, ev.memory_stage) == pytest.approx(
            ev.memory["total"] - GiB + held, rel=1e-9), system
    # `shardwise plan` prints it under the breakdown
    argv = ["--model", "llama3-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "8", "--top-k", "1",
            "--system", "torchtitan", "--plan", "dp_shard=8,zero_stage=3,micro_batch=1,activation_checkpoint=selective"]
    assert run_plan(_ns(*argv)) == 0
    out = capsys.readouterr().out
    assert f"torch's max_memory_reserved would read about {reserved / GiB:.1f} GiB" in out
    # ... and, torchtitan launching with expandable segments, that its fit is sized without the allowance
    assert "the fit is sized without the 10% fragmentation allowance" in out
    assert run_plan(_ns(*argv[:-4], "--system", "shardwise", *argv[-2:])) == 0
    assert "fragmentation allowance" not in capsys.readouterr().out


def test_accumulation_holds_the_shards_a_system_reduce_scatters_every_micro_batch():
    # torchtitan, Composer and DeepSpeed reduce-scatter each micro-batch's gradients into the rank's shards, which
    # then live through the later micro-batches: the loss's backward of the second holds them all. shardwise's
    # engine keeps its gradients unsharded until the last micro-batch instead (counted as FSDP buffers). Llama 3 8B
    # over 8 ranks: 3.74 GiB of fp32 shards, which the total left out until 2026-12-06
    args = preset("llama3-8b")
    cluster = Cluster(accelerator("h100"), 8)
    shards = 4 * num_params(args) / 8
    for system in ("torchtitan", "llm-foundry", "deepspeed-2021", "shardwise"):
        totals, moments = {}, {}
        for ga in (1, 4):
            training = _training(system, seq_len=8192, global_batch=8 * ga)
            plan = Plan(dp_shard=8, zero_stage=3, micro_batch=1, grad_accum=ga, activation_checkpoint="selective")
            totals[ga] = evaluate(args, training, plan, cluster).memory["total"]
            moments[ga] = moment_memory(args, training, plan, 0)
        assert moments[1]["loss_backward"]["grads"] == 0.0, system
        if system == "shardwise":
            assert moments[4]["loss_backward"]["grads"] == 0.0
            assert moments[4]["loss_backward"]["fsdp_buffers"] > moments[1]["loss_backward"]["fsdp_buffers"] + shards
            continue
        state = moments[4]["optimizer_step"]["grads"]  # DeepSpeed's ZeRO-3 gradient partitions: bf16, half
        assert state == pytest.approx(shards if system != "deepspeed-2021" else shards / 2, rel=1e-6), system
        for name in ("loss_backward", "first_block_backward", "late_block_backward"):
            if name not in moments[4]:
                continue
            assert moments[4][name]["grads"] == state, (system, name)
            # (the late block's backward of a single micro-batch already held the shards made by then)
            assert sum(moments[4][name].values()) == pytest.approx(
                sum(moments[1][name].values()) + state - moments[1][name]["grads"], rel=1e-9), (system, name)
        assert totals[4] == pytest.approx(totals[1] + state, rel=1e-3), system
    # Megatron-FSDP reduce-scatters every micro-batch in a pipeline too: the next micro-batch's first block backward
    # of a stage whose micro-batches are all in flight holds the first one's shards
    core = _training("megatron-core", seq_len=4096, global_batch=16)
    piped = moment_memory(args, core, Plan(pp=4, dp_shard=4, zero_stage=2, micro_batch=1, grad_accum=4), 0)
    assert piped["next_block_backward"]["grads"] == piped["optimizer_step"]["grads"] > 0
    # DeepSpeed's ZeRO-3 since v0.6 (the deepspeed preset) allocates its gradient partitions when it starts
    # (stage3.py, grad_partitions_flat_buffer): there at every moment of every micro-batch; v0.3.13's (above) in the
    # first backward. Under offload_optimizer they are on the host: none on the device
    for ga in (1, 4):
        speed = _training("deepspeed", seq_len=8192, global_batch=8 * ga)
        moments = moment_memory(args, speed, Plan(dp_shard=8, zero_stage=3, micro_batch=1, grad_accum=ga), 0)
        assert [items["grads"] for items in moments.values()] == pytest.approx([shards / 2] * len(moments)), ga
        offloaded = moment_memory(args, speed, Plan(dp_shard=8, zero_stage=3, micro_batch=1, grad_accum=ga,
                                                    offload="optimizer"), 0)
        assert {items["grads"] for items in offloaded.values()} == {0.0}, ga
        # ... as at ZeRO-2 (stage_1_and_2.py makes no device partition under cpu_offload)
        zero2 = moment_memory(args, speed, Plan(dp_shard=8, zero_stage=2, micro_batch=1, grad_accum=ga,
                                                offload="optimizer"), 0)
        assert {items["grads"] for items in zero2.values()} == {0.0}, ga


def test_expandable_segments_size_the_fit_without_the_fragmentation_allowance(tmp_path):
    # Under expandable segments the allocator remaps a free block's pages where an allocation needs them
    # (CUDACachingAllocator's release_cached_blocks), so holes between live tensors are not lost when memory runs
    # short: whether a plan fits is sized without the 10% allowance, while what the allocator holds before it runs
    # short (reserved_bytes) keeps it. By hand for Llama 3 8B at ZeRO-3 on 8 H100s, shardwise's engine.
    args = preset("llama3-8b")
    cluster = Cluster(accelerator("h100"), 8)
    plan = Plan(dp_shard=8, zero_stage=3, micro_batch=1, grad_accum=1, activation_checkpoint="selective")
    classic = _training("shardwise", seq_len=8192, global_batch=8)
    expandable = dataclasses.replace(classic, expandable_segments=True)
    ev, ev_x = evaluate(args, classic, plan, cluster), evaluate(args, expandable, plan, cluster)
    dynamic = sum(ev.memory.get(k, 0.0) for k in ("activations", "backward_and_logits", "fsdp_buffers",
                                                   "ddp_buckets"))
    assert ev.memory["fragmentation"] == pytest.approx(0.1 * dynamic, rel=1e-9) and dynamic > GiB
    assert ev_x.memory["fragmentation"] == 0.0
    assert ev_x.memory["total"] == pytest.approx(ev.memory["total"] - 0.1 * dynamic, rel=1e-9)
    assert reserved_bytes(args, expandable, plan, 0) == reserved_bytes(args, classic, plan, 0)
    # a device between the two totals holds the plan under expandable segments only
    board = (ev.memory["total"] + ev_x.memory["total"]) / 2
    small = Cluster(dataclasses.replace(accelerator("h100"), memory_bytes=board), 8)
    assert evaluate(args, expandable, plan, small).fits and not evaluate(args, classic, plan, small).fits
    # the peak is the largest moment without the allowance, which is not always the one with it: Llama 3 70B at
    # ZeRO-3 over 8 with full recompute, described as torchtitan, peaks late in the backward (the gradients made)
    # where with the allowance the loss's backward (the most activations) is larger
    args70, plan70 = preset("llama3-70b"), Plan(dp_shard=8, zero_stage=3, micro_batch=2, grad_accum=1,
                                                 activation_checkpoint="full")
    titan = _training("torchtitan", seq_len=8192, global_batch=16)
    assert peak_moment(args70, dataclasses.replace(titan, expandable_segments=False), plan70, 0) == "loss_backward"
    assert peak_moment(args70, titan, plan70, 0) == "late_block_backward"
    ev70 = evaluate(args70, titan, plan70, cluster)
    largest = max(sum(items.values()) for items in moment_memory(args70, titan, plan70, 0).values())
    assert ev70.memory["total"] == pytest.approx(
        largest + ev70.memory["allocator_segments"] + ev70.memory["fixed_overhead"], rel=1e-12)
    # torchtitan's launcher sets it (run_train.sh); the other presets' do not; a system file can say so
    assert SYSTEMS["torchtitan"].training_fields()["expandable_segments"] is True
    for name in ("shardwise", "megatron-core", "llm-foundry", "deepspeed", "torchtune"):
        assert SYSTEMS[name].training_fields()["expandable_segments"] is False, name
    path = tmp_path / "mine.toml"
    path.write_text('base = "shardwise"\nexpandable_segments = true\n')
    assert resolve_system(str(path)).training_fields()["expandable_segments"] is True
