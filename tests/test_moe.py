"""The mixture-of-experts block against references computed another way: a naive token-by-token loop over each
token's chosen experts, hand counts of routing and capacity, the Switch Transformer auxiliary loss written out
(Fedus et al. 2022, eq. 4) and differentiated by autograd, and the published size of Mixtral 8x7B.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from shardwise.model import TransformerBlock, build_model
from shardwise.model_args import ModelArgs, num_params, preset
from shardwise.moe import GroupedExperts, end_of_step, grouped_mm_supported, max_load


def _moe(seed: int = 0, **fields):
    """An MoE block (dim 32, 8 experts of hidden 16, top 2 unless overridden) with random weights: the router
    wide enough that no token's k-th and (k+1)-th scores are within rounding of each other."""
    args = ModelArgs(dim=32, n_heads=4, n_kv_heads=2, n_layers=1, ffn_hidden=64,
                     **{"n_experts": 8, "top_k": 2, "moe_ffn_hidden": 16, **fields})
    moe = TransformerBlock(args, 0).moe
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            std = 0.5 if name == "router.weight" else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return moe, args


def _tokens(bsz: int, seq: int, dim: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randn(bsz, seq, dim, generator=torch.Generator().manual_seed(seed))


def _route(args, router_weight, bias, token):
    """One token's experts (chosen by score + bias), their combine weights (from the score alone) and all scores."""
    logits = router_weight @ token
    scores = logits.softmax(-1) if args.score_func == "softmax" else logits.sigmoid()
    experts = torch.topk(scores + bias, args.top_k).indices
    weights = scores[experts]
    if args.route_norm:
        weights = weights / weights.sum()
    return experts.tolist(), weights * args.route_scale, scores


def _swiglu(x, w1, w3, w2):
    return w2 @ (F.silu(w1 @ x) * (w3 @ x))


def _naive(moe, args, x, router_weight=None, keep=None) -> torch.Tensor:
    """The block's output one token at a time: sum over its chosen experts of weight x expert(token), plus the
    shared experts; `keep(token index, expert)` False leaves that pair out."""
    router_weight = moe.router.weight if router_weight is None else router_weight
    w1, w3, w2 = moe.experts.w1, moe.experts.w3, moe.experts.w2
    out = []
    for t, token in enumerate(x.reshape(-1, args.dim)):
        experts, weights, _ = _route(args, router_weight, moe.expert_bias, token)
        y = sum(w * _swiglu(token, w1[e], w3[e], w2[e])
                for e, w in zip(experts, weights) if keep is None or keep(t, e))
        if moe.shared is not None:
            y = y + _swiglu(token, moe.shared.w1.weight, moe.shared.w3.weight, moe.shared.w2.weight)
        out.append(y)
    return torch.stack(out).view(x.shape)


def _choices(moe, args, x) -> list[list[int]]:
    return [_route(args, moe.router.weight, moe.expert_bias, t)[0] for t in x.reshape(-1, args.dim)]


# ---------------------------------------------------------------------------------------------------
# Dropless routing


@pytest.mark.parametrize("shared", [0, 1])
def test_dropless_computes_every_pair_once(shared):
    moe, args = _moe(n_shared_experts=shared)
    x = _tokens(2, 12)
    seen = []

    def spy(experts, rows, counts):
        seen.append((rows.clone(), list(counts)))
        return GroupedExperts.compute(experts, rows, counts)

    moe.experts.dispatch = spy
    with torch.no_grad():
        out = moe(x)
    # the experts received each (token, expert) pair once: grouped by expert, tokens in order
    choices = _choices(moe, args, x)
    by_expert = [[t for t, chosen in enumerate(choices) if e in chosen] for e in range(args.n_experts)]
    (rows, counts), = seen
    assert counts == [len(ts) for ts in by_expert]
    assert torch.equal(rows, x.reshape(-1, args.dim)[[t for ts in by_expert for t in ts]])
    torch.testing.assert_close(out, _naive(moe, args, x), rtol=0, atol=1e-5)


def _output_and_grads(moe, x, grouped: bool):
    moe.zero_grad()
    moe.experts.use_grouped_mm = grouped
    x = x.clone().requires_grad_()
    out = moe(x)
    (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in moe.named_parameters()}


def _grouped_mm_calls(monkeypatch) -> list:
    calls, real = [], torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("shape", [(2, 12), (1, 1)], ids=["batch", "one-token"])  # one token: empty groups
def test_grouped_gemm_equals_the_loop(monkeypatch, shape):
    moe, _ = _moe(n_shared_experts=1)
    x = _tokens(*shape)
    assert grouped_mm_supported(x, moe.experts.w1)
    calls = _grouped_mm_calls(monkeypatch)
    grouped = _output_and_grads(moe, x, grouped=True)
    assert calls, "the grouped GEMM path did not run"
    calls.clear()
    loop = _output_and_grads(moe, x, grouped=False)
    assert not calls
    torch.testing.assert_close(grouped, loop, rtol=1e-6, atol=1e-6)


def test_unaligned_hidden_falls_back_to_the_loop(monkeypatch):
    moe, args = _moe(moe_ffn_hidden=18)  # 18 fp32 values: rows of 72 bytes, not 16-byte aligned
    x = _tokens(2, 12)
    assert moe.experts.use_grouped_mm and not grouped_mm_supported(x, moe.experts.w1)
    calls = _grouped_mm_calls(monkeypatch)
    with torch.no_grad():
        out = moe(x)
    assert not calls
    torch.testing.assert_close(out, _naive(moe, args, x), rtol=0, atol=1e-5)


def test_sigmoid_scores_with_bias_and_route_scale():
    # DeepSeek-V3: sigmoid scores, the balancing bias steering the choice only, weights renormalised then x 2.5
    moe, args = _moe(score_func="sigmoid", route_scale=2.5, n_shared_experts=1)
    moe.expert_bias.copy_(torch.linspace(-0.3, 0.3, args.n_experts))
    x = _tokens(2, 12)
    unbiased = [_route(args, moe.router.weight, torch.zeros(args.n_experts), t)[0] for t in x.reshape(-1, args.dim)]
    assert unbiased != _choices(moe, args, x)  # the bias changes some choices
    with torch.no_grad():
        torch.testing.assert_close(moe(x), _naive(moe, args, x), rtol=0, atol=1e-5)


def test_an_fp32_router_scores_bf16_tokens_as_fp32_does():
    """Under bf16 autocast the gate's matmul runs in bf16 (as torchtitan's), its logits rounded before the fp32
    softmax; router_dtype = 'fp32' (Megatron-Core's --moe-router-dtype fp32) runs it in fp32: the scores are then
    those of fp32 on the same inputs, bit for bit, and the gradient reaches the router weight in fp32."""
    moe, _ = _moe()
    x = _tokens(1, 64).reshape(-1, 32)
    zero = torch.zeros(8)
    with torch.no_grad():
        reference = moe.router(x, zero)[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = moe.router(x, zero)[0]
        fp32_moe, _ = _moe(router_dtype="fp32")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fp32 = fp32_moe.router(x, zero)[0]
    assert not torch.equal(auto, reference)  # bf16's rounding of the logits shows
    assert torch.equal(fp32, reference)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fp32_moe.router(x, zero)[0].sum().backward()
    assert fp32_moe.router.weight.grad.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------
# Capacity


def test_capacity_keeps_each_experts_first_tokens():
    moe, args = _moe(n_experts=4, capacity_factor=0.5, n_shared_experts=1)
    x = _tokens(2, 8)
    moe.train()
    out = moe(x)
    tokens = 2 * 8
    capacity = math.ceil(0.5 * tokens * args.top_k / args.n_experts)
    choices = _choices(moe, args, x)
    by_expert = [[t for t, chosen in enumerate(choices) if e in chosen] for e in range(args.n_experts)]
    kept = {(t, e) for e, ts in enumerate(by_expert) for t in ts[:capacity]}
    dropped = sum(max(0, len(ts) - capacity) for ts in by_expert)
    assert dropped > 0
    assert moe.dropped.item() == dropped
    assert moe.tokens_per_expert.tolist() == [len(ts) for ts in by_expert]  # counted before the drop
    reference = _naive(moe, args, x, keep=lambda t, e: (t, e) in kept)
    torch.testing.assert_close(out.detach(), reference.detach(), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Load balancing


def _switch_aux_loss(args, router_weight, x, alpha: float) -> torch.Tensor:
    """alpha x E x sum_i f_i P_i per sequence, summed over sequences: f_i the share of the sequence's seq x k
    choices that went to expert i, P_i the mean over the sequence of expert i's softmax probability."""
    total = 0.0
    for sequence in x:
        probs = torch.stack([(router_weight @ t).softmax(-1) for t in sequence])
        counts = torch.zeros(args.n_experts)
        for p in probs:
            counts[torch.topk(p.detach(), args.top_k).indices] += 1
        f = counts / (len(sequence) * args.top_k)
        total = total + alpha * args.n_experts * (f * probs.mean(0)).sum()
    return total


@pytest.mark.parametrize("scale", [1.0, 0.0])
def test_aux_loss_value_and_router_gradient(scale):
    alpha = 0.1
    moe, args = _moe(n_experts=4, aux_loss_coeff=alpha)
    x = _tokens(3, 8)
    # a main objective small enough that the aux loss's share of the gradient stands out of its rounding
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)) * 1e-2
    moe.train()
    moe.aux_grad_scale = scale
    (moe(x) * target).sum().backward()
    # the same objective written out, differentiated by autograd: main + scale x aux
    weight = moe.router.weight.detach().clone().requires_grad_()
    aux = _switch_aux_loss(args, weight, x, alpha)
    main = (_naive(moe, args, x, router_weight=weight) * target).sum()
    main_grad, aux_grad = torch.autograd.grad(main, weight, retain_graph=True)[0], torch.autograd.grad(aux, weight)[0]
    assert aux_grad.abs().max() > 0.1 * main_grad.abs().max()
    assert moe.aux_loss.item() == pytest.approx(aux.item(), rel=1e-6)
    torch.testing.assert_close(moe.router.weight.grad, main_grad + scale * aux_grad, rtol=1e-5, atol=1e-7)


def test_router_z_loss_value_and_router_gradient():
    """ST-MoE's z-loss (eq. 5), per sequence as the balancing loss: beta x the mean over a sequence's tokens of
    (log sum_i exp(logit_i))^2, summed over sequences, written out one token at a time; with the balancing loss on
    too, the router's gradient is the main objective's + scale x both losses'."""
    alpha, beta, scale = 0.1, 0.05, 0.5
    moe, args = _moe(n_experts=4, aux_loss_coeff=alpha, z_loss_coeff=beta)
    x = _tokens(3, 8)
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)) * 1e-2
    moe.train()
    moe.aux_grad_scale = scale
    (moe(x) * target).sum().backward()
    weight = moe.router.weight.detach().clone().requires_grad_()
    z = sum(beta * sum(torch.log(sum(torch.exp(v) for v in weight @ t)) ** 2 for t in sequence) / len(sequence)
            for sequence in x)
    aux = _switch_aux_loss(args, weight, x, alpha)
    main = (_naive(moe, args, x, router_weight=weight) * target).sum()
    main_grad = torch.autograd.grad(main, weight)[0]
    z_grad, aux_grad = torch.autograd.grad(z, weight)[0], torch.autograd.grad(aux, weight)[0]
    assert z_grad.abs().max() > 0.1 * main_grad.abs().max()
    assert moe.z_loss.item() == pytest.approx(z.item(), rel=1e-6)
    assert moe.aux_loss.item() == pytest.approx(aux.item(), rel=1e-6)
    torch.testing.assert_close(moe.router.weight.grad, main_grad + scale * (aux_grad + z_grad), rtol=1e-5, atol=1e-7)
    stats = end_of_step([moe], 0.0)
    assert stats[3].item() == pytest.approx(z.item(), rel=1e-6) and moe.z_loss.item() == 0


def test_expert_bias_moves_towards_the_mean_load():
    moe, args = _moe(n_experts=4, bias_update_rate=0.1)
    x = _tokens(2, 16)
    moe.train()
    moe(x)
    load = torch.bincount(torch.tensor(_choices(moe, args, x)).flatten(), minlength=args.n_experts).float()
    assert (load < load.mean()).any() and (load > load.mean()).any()
    stats = end_of_step([moe], 0.1)
    under, over = load < load.mean(), load > load.mean()
    assert (moe.expert_bias[under] == 0.1).all() and (moe.expert_bias[over] == -0.1).all()
    assert (moe.expert_bias[load == load.mean()] == 0).all()
    assert stats[2].item() == x.shape[0] * x.shape[1] * args.top_k  # routed pairs
    assert moe.tokens_per_expert.sum().item() == 0  # the step's statistics are cleared



def test_max_load_is_the_busiest_expert_over_the_mean_of_the_worst_layer():
    """Counted by hand from each layer's choices: two blocks over different tokens, the larger ratio reported;
    read before end_of_step clears the counts."""
    layers = [_moe(seed=s)[0] for s in (0, 1)]
    args = _moe()[1]
    ratios = []
    for i, moe in enumerate(layers):
        moe.train()
        x = _tokens(2, 16, seed=10 + i) + 0.3 * i
        moe(x)
        load = torch.bincount(torch.tensor(_choices(moe, args, x)).flatten(), minlength=args.n_experts).float()
        ratios.append((load.max() / load.mean()).item())
    assert ratios[0] != pytest.approx(ratios[1])
    assert max_load(layers).item() == pytest.approx(max(ratios))
    end_of_step(layers, 0.0)
    assert max_load(layers).item() == 0.0 and max_load([torch.nn.Linear(2, 2)]).item() == 0.0

def test_expert_bias_evens_the_load_over_steps():
    moe, args = _moe(n_experts=4)
    with torch.no_grad():
        moe.router.weight[0] += 0.3  # one expert favoured by tokens with a positive mean
    moe.train()
    loads = []
    for step in range(40):
        x = _tokens(2, 16, seed=step) + 0.5
        loads.append(torch.bincount(torch.tensor(_choices(moe, args, x)).flatten(), minlength=args.n_experts))
        moe(x)
        end_of_step([moe], 0.02)
    # a sign step of fixed size ends circling the balance, so judge the load averaged over the last steps
    first, last = loads[0].float(), torch.stack(loads[-10:]).float().mean(0)
    assert (last.max() - last.min()) < (first.max() - first.min()) / 4


# ---------------------------------------------------------------------------------------------------
# Sizes


def _experts_not_used(model, args) -> int:
    """Parameters of the n_experts - top_k routed experts a token skips, counted on the built model."""
    per_expert = sum(p[0].numel() for layer in model.layers.values() if hasattr(layer, "moe")
                     for p in (layer.moe.experts.w1, layer.moe.experts.w3, layer.moe.experts.w2))
    return (args.n_experts - args.top_k) * per_expert


@pytest.mark.parametrize("args", [
    preset("debug-moe"),
    preset("debug-moe", n_layers=5, n_shared_experts=2, n_dense_layers=2, top_k=3, tie_embeddings=True),
], ids=["debug-moe", "shared-dense-tied"])
def test_num_params_matches_the_built_model(args):
    model = build_model(args)
    total = sum(p.numel() for p in model.parameters())
    assert num_params(args) == total
    assert sum(hasattr(layer, "moe") for layer in model.layers.values()) == args.n_layers - args.n_dense_layers
    assert num_params(args, active=True) == total - _experts_not_used(model, args)


def test_mixtral_8x7b_size_is_the_published_one():
    # Jiang et al. 2024: 46.7B parameters, 12.9B used per token
    args = preset("mixtral-8x7b")
    assert round(num_params(args) / 1e9, 1) == 46.7
    assert round(num_params(args, active=True) / 1e9, 1) == 12.9
