"""Context parallelism computes what one device computes: the positions, the attention, the whole model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from shardwise.activation_checkpoint import apply_activation_checkpointing
from shardwise.model import build_model, causal_attention, materialize
from shardwise.model_args import preset
from shardwise.parallel.context_parallel import (
    apply_context_parallel,
    context_parallel_attention,
    cp_positions,
    load_balanced_positions,
    shard_sequence,
)
from tests.distributed import run_distributed

SEQ = 16
AC_POLICIES = ("none", "full", "selective")


def test_positions_partition_the_sequence_with_equal_causal_work():
    for seq, cp in [(8, 1), (16, 2), (24, 3), (32, 4)]:
        parts = [load_balanced_positions(seq, cp, r) for r in range(cp)]
        assert sorted(torch.cat(parts).tolist()) == list(range(seq))
        # a query at position p attends to the p + 1 keys k <= p
        work = {int((part + 1).sum()) for part in parts}
        assert work == {seq * (seq + 1) // 2 // cp}


def test_positions_reject_a_length_not_divisible_by_twice_cp():
    with pytest.raises(ValueError, match=r"divisible by 2 \* cp = 4"):
        load_balanced_positions(10, 2, 0)


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    args = preset("tiny")
    return {
        # GQA: 4 query heads over 2 key/value heads
        "q": torch.randn(2, 4, SEQ, 8, generator=g),
        "k": torch.randn(2, 2, SEQ, 8, generator=g),
        "v": torch.randn(2, 2, SEQ, 8, generator=g),
        "grad_out": torch.randn(2, 4, SEQ, 8, generator=g),
        "tokens": torch.randint(0, args.vocab_size, (2, SEQ), generator=g),
        "targets": torch.randint(0, args.vocab_size, (2, SEQ), generator=g),
    }


def _attention_grads(attention, inputs, shard) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    qkv = {n: shard(inputs[n]).requires_grad_() for n in "qkv"}
    out = attention(qkv["q"], qkv["k"], qkv["v"])
    (out * shard(inputs["grad_out"])).sum().backward()
    return out.detach(), {n: t.grad for n, t in qkv.items()}


def _model_grads(inputs, ac_policy: str, prepare, shard, positions) -> tuple[torch.Tensor, dict]:
    args = preset("tiny")
    model = build_model(args)
    materialize(model, args, "cpu", seed=0)
    prepare(model)
    apply_activation_checkpointing(model, ac_policy)
    logits = model(shard(inputs["tokens"]), positions)
    # each rank sums the loss of its own tokens; the sum over ranks is the single-device sum
    F.cross_entropy(logits.flatten(0, 1), shard(inputs["targets"]).flatten(), reduction="sum").backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def _cp_rank(cp: int, inputs: dict[str, torch.Tensor]) -> dict:
    mesh = init_device_mesh("cpu", (cp, 1), mesh_dim_names=("cp", "other"))
    cp_mesh, group = mesh["cp"], mesh["cp"].get_group()
    positions = cp_positions(SEQ, cp_mesh)
    attention = lambda q, k, v: context_parallel_attention(q, k, v, group=group)  # noqa: E731
    recomputed = lambda q, k, v: checkpoint(attention, q, k, v, use_reentrant=False)  # noqa: E731
    result = {
        "positions": positions,
        "attention": _attention_grads(attention, inputs, lambda x: shard_sequence(x, positions, dim=2)),
        "attention_checkpointed": _attention_grads(recomputed, inputs, lambda x: shard_sequence(x, positions, dim=2)),
    }
    for policy in AC_POLICIES:
        logits, grads = _model_grads(inputs, policy, lambda m: apply_context_parallel(m, cp_mesh),
                                     lambda x: shard_sequence(x, positions), positions)
        for g in grads.values():
            dist.all_reduce(g, group=group)  # FSDP does this in the engine: cp ranks hold the same parameters
        result[f"model_{policy}"] = (logits, grads)
    # a 1-rank cp mesh leaves the model alone
    model = build_model(preset("tiny"))
    apply_context_parallel(model, mesh["other"])
    result["noop"] = all(layer.attention.attention_fn is causal_attention for layer in model.layers.values())
    return result


@pytest.fixture(scope="module")
def inputs() -> dict[str, torch.Tensor]:
    return _inputs()


@pytest.fixture(scope="module", params=[2, 4], ids=lambda cp: f"cp{cp}")
def ranks(request, inputs) -> list[dict]:
    return run_distributed(_cp_rank, request.param, request.param, inputs)


def _assemble(ranks: list[dict], pick, dim: int) -> torch.Tensor:
    """The full tensor from the ranks' local slices, each put back at its rank's positions."""
    pieces = [pick(r) for r in ranks]
    shape = list(pieces[0].shape)
    shape[dim] *= len(ranks)
    full = torch.zeros(shape, dtype=pieces[0].dtype)
    for r, piece in zip(ranks, pieces):
        full.index_copy_(dim, r["positions"], piece)
    return full


@pytest.mark.parametrize("key", ["attention", "attention_checkpointed"])
@pytest.mark.multiprocess
def test_attention_and_its_gradients_equal_one_device(ranks, inputs, key):
    out, grads = _attention_grads(causal_attention, inputs, lambda x: x.clone())
    torch.testing.assert_close(_assemble(ranks, lambda r: r[key][0], dim=2), out, rtol=1e-6, atol=1e-6)
    for n in "qkv":
        torch.testing.assert_close(_assemble(ranks, lambda r: r[key][1][n], dim=2), grads[n], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("policy", AC_POLICIES)
@pytest.mark.multiprocess
def test_model_logits_and_gradients_equal_one_device(ranks, inputs, policy):
    logits, grads = _model_grads(inputs, "none", lambda m: None, lambda x: x, None)
    key = f"model_{policy}"
    torch.testing.assert_close(_assemble(ranks, lambda r: r[key][0], dim=1), logits, rtol=1e-5, atol=1e-5)
    for r in ranks:
        for name, g in grads.items():
            torch.testing.assert_close(r[key][1][name], g, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.multiprocess
def test_one_rank_cp_mesh_is_a_no_op(ranks):
    assert all(r["noop"] for r in ranks)
