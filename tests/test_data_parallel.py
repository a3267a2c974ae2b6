"""ZeRO stages hold what they claim, and move the bytes ZeRO (Rajbhandari et al. 2020) and ring collectives say."""

from pathlib import Path

import pytest
from torch.distributed.tensor import DTensor

from shardwise.config import load_config
from shardwise.model_args import num_params
from shardwise.train import counted_step

from distributed import run_distributed

pytestmark = pytest.mark.multiprocess  # every test here starts rank processes

CONFIG = str(Path(__file__).parent / "configs" / "parity.toml")


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _steps(layouts):
    """_one_step for several layouts in one set of processes (saves starting them again)."""
    return [_one_step(overrides) for overrides in layouts]


def _one_step(overrides):
    """One step under the layout: what a rank holds and what it moves."""
    stats, model, optimizer, runtime = counted_step(load_config(CONFIG, ["optim.name='adamw'", *overrides]))
    inner = optimizer.inner if hasattr(optimizer, "inner") else optimizer
    state = sum(_local(s["exp_avg"]).numel() + _local(s["exp_avg_sq"]).numel() for s in inner.state.values())
    params = sum(_local(p).numel() for p in model.parameters())
    root = sum(_local(p).numel() for name, p in model.named_parameters() if not name.startswith("layers."))
    return {"state": state, "params": params, "root_params": root, "wire": dict(stats.wire),
            "calls": dict(stats.calls)}


def _psi():
    return num_params(load_config(CONFIG).model)


@pytest.mark.parametrize("n", [2, 4])
def test_zero_stages_memory_and_volume(n):
    psi, fp32 = _psi(), 4
    ring = (n - 1) / n
    layouts = [[f"parallel.dp_replicate={n}"], [f"parallel.dp_replicate={n}", "parallel.zero_stage=1"],
               [f"parallel.dp_shard={n}", "parallel.zero_stage=2"], [f"parallel.dp_shard={n}", "parallel.zero_stage=3"],
               [f"parallel.dp_shard={n}", "parallel.zero_stage=2", "train.grad_accum=2"],
               [f"parallel.dp_shard={n}", "parallel.zero_stage=3", "train.grad_accum=2"]]
    measured = run_distributed(_steps, n, layouts)[0]
    zero0, zero1, zero2, zero3, zero2_accum, zero3_accum = measured
    # what each rank holds: ZeRO-0 everything; ZeRO-1 1/N of Adam's two moments; ZeRO-2/3 1/N of everything
    assert zero0["params"] == psi and zero0["state"] == 2 * psi
    assert zero1["params"] == psi and 2 * psi / n <= zero1["state"] <= 2 * psi / n + 2 * n * 64
    assert zero2["params"] == zero3["params"] == psi / n and zero2["state"] == zero3["state"] == 2 * psi / n
    # bytes on the wire per rank (ring all-reduce): DDP all-reduce 2 Psi (N-1)/N, plus the one fp32 scalar
    # of the loss the ranks sum for reporting
    loss = 2 * fp32 * ring
    assert zero0["wire"] == {"all_reduce": pytest.approx(2 * psi * fp32 * ring + loss, rel=1e-12)}
    # ZeRO-1: the same all-reduce, then an all-gather of the updated slices (Psi, padded to N equal slices)
    assert zero1["wire"]["all_reduce"] == pytest.approx(2 * psi * fp32 * ring + loss, rel=1e-12)
    assert psi * fp32 * ring <= zero1["wire"]["all_gather"] <= (psi + 64 * n) * fp32 * ring
    # ZeRO-3: all-gather in forward and again in backward, reduce-scatter of gradients: 3 Psi (N-1)/N, less
    # the backward re-gather of the root (embedding, final norm, head), which stays gathered after forward
    root = zero3["root_params"] * n
    assert zero3["wire"]["reduce_scatter"] == pytest.approx(psi * fp32 * ring, rel=1e-12)
    assert zero3["wire"]["all_gather"] == pytest.approx((2 * psi - root) * fp32 * ring, rel=1e-12)
    # ZeRO-2 keeps the blocks gathered from forward to backward: one all-gather of everything
    assert zero2["wire"]["all_gather"] == pytest.approx(psi * fp32 * ring, rel=1e-12)
    assert zero2["wire"]["reduce_scatter"] == pytest.approx(psi * fp32 * ring, rel=1e-12)
    # accumulating over 2 micro-batches: gradients are reduced once, after the last; the weights are gathered
    # again for every micro-batch (FSDP2 reshards after each backward)
    assert zero2_accum["wire"]["reduce_scatter"] == zero3_accum["wire"]["reduce_scatter"] == pytest.approx(
        psi * fp32 * ring, rel=1e-12)
    assert zero2_accum["wire"]["all_gather"] == pytest.approx(2 * psi * fp32 * ring, rel=1e-12)
    assert zero3_accum["wire"]["all_gather"] == pytest.approx(2 * (2 * psi - root) * fp32 * ring, rel=1e-12)
    # the planner's data-parallel traffic is the engine's: on a link of 1 byte/s with no latency its
    # communication seconds are the bytes each rank sends (the loss's and the gradient norm's scalars included)
    for overrides, step in zip(layouts, measured):
        planned = _planner_traffic(load_config(CONFIG, ["optim.name='adamw'", *overrides]))
        assert planned == pytest.approx(sum(step["wire"].values()), rel=2e-3), overrides


def _planner_traffic(cfg) -> float:
    import dataclasses

    from shardwise.planner import Cluster, Plan, Training, accelerator, evaluate

    p = cfg.parallel
    unit = dataclasses.replace(accelerator("h100"), intra_node_bw=1.0, comm_efficiency=1.0, intra_node_latency=0.0)
    plan = Plan(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, zero_stage=p.zero_stage,
                micro_batch=cfg.train.micro_batch, grad_accum=cfg.train.grad_accum, mixed_precision=p.mixed_precision)
    training = Training(seq_len=cfg.data.seq_len, global_batch=cfg.train.micro_batch * cfg.train.grad_accum * p.dp,
                        precision=cfg.train.precision, optimizer="adamw")
    return evaluate(cfg.model, training, plan, Cluster(unit, p.world_size, gpus_per_node=p.world_size)
                    ).time.comm_total_s


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_volume_per_layer(sp):
    """Megatron TP: per layer 2 all-reduces of b x s x d in forward and 2 in backward (the f and g operators);
    sequence parallelism turns each into an all-gather plus a reduce-scatter, the same bytes."""
    cfg = load_config(CONFIG)
    b, s, d, tp = cfg.train.micro_batch, cfg.data.seq_len, cfg.model.dim, 2
    all_reduce = 2 * b * s * d * 4 * (tp - 1) / tp  # wire bytes of one ring all-reduce of b x s x d fp32
    layouts = [[f"parallel.tp={tp}", f"parallel.sequence_parallel={str(sp).lower()}", f"model.n_layers={layers}"]
               for layers in (2, 4)]
    runs = dict(zip((2, 4), run_distributed(_steps, tp, layouts)[0]))
    per_layer = {k: (runs[4]["wire"][k] - runs[2]["wire"].get(k, 0)) / 2 for k in runs[4]["wire"]}
    per_layer = {k: v for k, v in per_layer.items() if v}
    if sp:
        # 2 all-gathers forward (before attention and MLP) + 2 backward (of the forward reduce-scatters), each
        # half an all-reduce's bytes; reduce-scatters likewise
        assert per_layer == {"all_gather": pytest.approx(2 * all_reduce),
                             "reduce_scatter": pytest.approx(2 * all_reduce)}
    else:
        assert per_layer == {"all_reduce": pytest.approx(4 * all_reduce)}


def _params_after_evaluation(overrides):
    """Whether, after a validation pass, the model's parameters are still the optimizer's (and its state dict,
    which maps one to the other by identity, can be taken)."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from shardwise.data import Batch
    from shardwise.train import evaluate

    cfg = load_config(CONFIG, ["optim.name='adamw'", *overrides])
    _, model, optimizer, runtime = counted_step(cfg)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.data.seq_len + 1))
    evaluate(model, [Batch(tokens[:, :-1], tokens[:, 1:], [0])], runtime.device, cfg.train.precision, runtime)
    registered = {id(p) for p in model.parameters()}
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    get_optimizer_state_dict(model, optimizer)
    return registered == optimized


def test_validation_leaves_fsdp_parameters_sharded():
    """FSDP2 reshards a module kept gathered after forward (the root; every block under ZeRO-2) in backward; a
    validation pass has none, and once left the gathered tensors registered: the next checkpoint failed."""
    layouts = [["parallel.dp_shard=2", "parallel.zero_stage=3"], ["parallel.dp_shard=2", "parallel.zero_stage=2"]]
    assert run_distributed(_evaluations, 2, layouts)[0] == [True, True]


def _evaluations(layouts):
    return [_params_after_evaluation(overrides) for overrides in layouts]


def _zero1_state_round_trip():
    """Two AdamW steps under ZeRO-1 and unsharded; the sharded one's flattened state, and that state loaded
    into a fresh ShardedOptimizer (lr 0.5 before, the saved 0.1 after)."""
    import copy

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from shardwise.parallel.data_parallel import (
        ShardedOptimizer,
        optimizer_load_targets,
        optimizer_state_dict,
        set_optimizer_state,
    )

    torch.manual_seed(0)  # every rank: the same parameters and inputs (gradients replicated, as ZeRO-1 needs)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 1))  # 15, 5, 5 and 1 values: uneven and empty slices
    reference = copy.deepcopy(model)
    sharded = ShardedOptimizer(model, lambda named: torch.optim.AdamW([p for _, p, _ in named], lr=0.1),
                               dist.group.WORLD)
    plain = torch.optim.AdamW(reference.parameters(), lr=0.1)
    for _ in range(2):
        x = torch.randn(4, 3)
        for m, opt in ((model, sharded), (reference, plain)):
            m(x).sum().backward()
            opt.step()
            opt.zero_grad()
    flat = optimizer_state_dict(model, sharded)
    expected = get_optimizer_state_dict(reference, plain, options=StateDictOptions(flatten_optimizer_state_dict=True))

    fresh = ShardedOptimizer(model, lambda named: torch.optim.AdamW([p for _, p, _ in named], lr=0.5),
                             dist.group.WORLD)
    saved = {k: (v.shape, v.dtype) for k, v in flat.items() if torch.is_tensor(v)}
    live = optimizer_load_targets(model, fresh, saved)
    for k, v in live.items():
        if torch.is_tensor(v):
            v.copy_(flat[k])
        else:
            live[k] = flat[k]
    set_optimizer_state(model, fresh, live)
    states = [(sharded.inner.state[a], fresh.inner.state[b])
              for (_, a, _), (_, b, _) in zip(sharded.params, fresh.params)]
    return {"keys": sorted(flat) == sorted(expected),
            "values": all(torch.equal(flat[k], v) if torch.is_tensor(v) else flat[k] == v for k, v in expected.items()),
            "loaded": all(s.keys() == t.keys() and all(torch.equal(s[k], t[k]) for k in s) for s, t in states),
            "lr": [g["lr"] for g in fresh.param_groups]}


def test_zero1_state_dict_is_the_unsharded_optimizers_and_loads_back():
    for result in run_distributed(_zero1_state_round_trip, 2):
        assert result == {"keys": True, "values": True, "loaded": True, "lr": [0.1]}


def _mixed_precision_step(overrides):
    """One counted step under the layout with dtype probes: the gathered weight and the residual stream a block
    sees in forward, the stored shards, their gradients and Adam's moments after it; the parameters after it."""
    import torch

    dtypes = {}

    def weight_probe(module, args, output):  # inside the block's forward: FSDP has put the gathered weight there
        dtypes.setdefault("gathered_weight", module.weight.dtype)

    def residual_probe(module, args, output):
        dtypes.setdefault("residual", output.dtype)

    from shardwise.config import autocast_precision
    from shardwise.data import Batch
    from shardwise.train import evaluate

    def grad_probe(optimizer, args, kwargs):  # what the optimizer steps with: the reduced, sharded gradients
        dtypes["grads"] = {p.grad.dtype for group in optimizer.param_groups for p in group["params"]
                           if p.grad is not None}

    cfg = load_config(CONFIG, ["optim.name='adamw'", "train.precision='bf16'", *overrides])
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    hook = register_optimizer_step_pre_hook(grad_probe)
    try:
        stats, model, optimizer, runtime = counted_step(cfg)
    finally:
        hook.remove()
    # a forward (validation's) after the step, probed at the first block
    block = next(iter(model.layers.values()))
    handles = [block.attention.wq.register_forward_hook(weight_probe), block.register_forward_hook(residual_probe)]
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.data.seq_len + 1))
    evaluate(model, [Batch(tokens[:, :-1], tokens[:, 1:], [0])], runtime.device, autocast_precision(cfg), runtime)
    for handle in handles:
        handle.remove()
    shard = next(iter(model.parameters()))
    moments = {s["exp_avg"].dtype for s in optimizer.state.values()}
    return {"wire": dict(stats.wire), "gathered_weight": dtypes["gathered_weight"], "residual": dtypes["residual"],
            "shard": shard.dtype, "grads": dtypes["grads"], "moments": moments,
            "params": [_local(p).detach().clone() for p in model.parameters()]}


def _mixed_precision_steps(layouts):
    return [_mixed_precision_step(overrides) for overrides in layouts]


def test_fsdp_mixed_precision_gathers_bf16_and_reduces_fp32():
    """parallel.mixed_precision = 'fsdp' (FSDP2's MixedPrecisionPolicy, torchtitan's default): the weights a block
    computes with and the residual stream are bf16, the shards, their gradients and Adam's moments fp32; the
    all-gathers move 2 bytes a parameter, the reduce-scatter 4 (fp32 reduction); the planner's layout 'fsdp-mp'
    moves the same bytes; ZeRO-2 and ZeRO-3 compute the same step. Under autocast the block sees fp32 weights."""
    import torch

    n, fp32, bf16 = 2, 4, 2
    ring = (n - 1) / n
    mp = ["parallel.dp_shard=2", "parallel.mixed_precision='fsdp'"]
    layouts = [[*mp, "parallel.zero_stage=3"], [*mp, "parallel.zero_stage=2"],
               ["parallel.dp_shard=2", "parallel.zero_stage=3"]]
    zero3, zero2, autocast = run_distributed(_mixed_precision_steps, n, layouts)[0]
    for run in (zero3, zero2):
        assert run["gathered_weight"] == run["residual"] == torch.bfloat16
        assert run["shard"] == torch.float32 and run["grads"] == run["moments"] == {torch.float32}
    assert autocast["gathered_weight"] == autocast["residual"] == torch.float32
    psi = _psi()
    # the root (embedding, final norm, head) is gathered once, the blocks twice: the fp32 run's all-gathers give it
    root = 2 * psi - autocast["wire"]["all_gather"] / (fp32 * ring)
    assert zero3["wire"]["all_gather"] == pytest.approx((2 * psi - root) * bf16 * ring, rel=1e-12)
    assert zero3["wire"]["reduce_scatter"] == pytest.approx(psi * fp32 * ring, rel=1e-12)
    assert zero2["wire"]["all_gather"] == pytest.approx(psi * bf16 * ring, rel=1e-12)
    # the same bf16 forward and backward, only resharded differently: the same update, bit for bit
    for a, b in zip(zero3["params"], zero2["params"]):
        assert torch.equal(a, b)
    # and not autocast's: the weights moved by other bf16 roundings (Adam's first steps are ~lr x sign(g))
    assert any(not torch.equal(a, b) for a, b in zip(zero3["params"], autocast["params"]))
    for overrides, step in zip(layouts[:2], (zero3, zero2)):
        cfg = load_config(CONFIG, ["optim.name='adamw'", "train.precision='bf16'", *overrides])
        assert _planner_traffic(cfg) == pytest.approx(sum(step["wire"].values()), rel=2e-3), overrides
