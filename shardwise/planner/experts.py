"""A mixture of experts in the planner: how many routed copies of its tokens each rank computes and exchanges, and
how unevenly the router spreads them over the expert-parallel ranks. Derivations in docs/planner.md, "Mixture of
experts".

Token choice: each token goes to its top_k of n_experts (shardwise.moe). Under expert parallelism (ep > 1) a rank
holds n_experts / ep of them and computes them for the tokens of all ep ranks that chose them, so the busiest rank
of an ep group computes more than the mean and everyone waits for it (each all-to-all is a barrier).
"""

from __future__ import annotations

import functools
import math

from shardwise.model_args import ModelArgs
from shardwise.planner.plan import Plan
from shardwise.planner.workload import Training

_GRID = 4001  # midpoints over [-9, 9]: the normal tails beyond hold less than 1e-18
_LO, _HI = -9.0, 9.0


def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def _integrate(f) -> float:
    step = (_HI - _LO) / _GRID
    return step * sum(f(_LO + (i + 0.5) * step) for i in range(_GRID))


@functools.cache
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] = integral of x n phi(x) Phi(x)^(n-1) dx (0 for n = 1)."""
    if n <= 1:
        return 0.0
    return _integrate(lambda x: x * n * _phi(x) * _cdf(x) ** (n - 1))


@functools.cache
def topk_sensitivity(n_experts: int, top_k: int) -> float:
    """beta = d ln P(expert i is among a token's top_k) / d ln sigma_i, at equal sigmas: how much an expert whose
    scores spread wider (a larger router row) is chosen more often.

    With the other n - 1 = n_experts - 1 scores independent N(0, 1) and y the k-th largest of them (density
    n C(n-1, k-1) Phi(y)^(n-k) (1 - Phi(y))^(k-1) phi(y)), expert i is chosen when its score, N(0, sigma^2), exceeds
    y: P = E_y[1 - Phi(y / sigma)] and dP / d ln sigma = E_y[y phi(y)] at sigma = 1."""
    n, k = n_experts - 1, top_k
    if k > n:
        return 0.0
    scale = n * math.comb(n - 1, k - 1)

    def density(y: float) -> float:
        return scale * _cdf(y) ** (n - k) * (1 - _cdf(y)) ** (k - 1) * _phi(y)

    chosen = _integrate(lambda y: (1 - _cdf(y)) * density(y))  # = k / n_experts
    return _integrate(lambda y: y * _phi(y) * density(y)) / chosen


def init_imbalance(args: ModelArgs, tokens: float, ep: int) -> float:
    """Routed copies on the busiest of `ep` ranks over the mean, for a router as shardwise initialises it (rows
    N(0, 0.02^2), so a row's norm is 0.02 sqrt(d) (1 + N(0, 1/(2d)))) and `tokens` independent random tokens per rank
    (the RMSNorm output: norm sqrt(d), random direction, so a score is N(0, |row|^2)):

        1 + e_ep sqrt( (E - k) / ((E - 1) T k)  +  beta^2 ep / (2 d E) )

    The first term is the sampling spread of T tokens' k choices over a rank's E / ep experts (hypergeometric), the
    second the router's own: expert i is chosen with probability (k / E)(1 + beta delta_i), delta_i its row's relative
    norm deviation, and a rank sums E / ep of them. Both are spreads of loads that sum to the group's total, which
    makes the busiest rank's excess e_ep (expected_max_normal) times the spread over sqrt(1 - 1/ep) (the sum removes
    one degree of freedom), folded into the formula above. Measured with the real Router in
    tests/test_planner_moe.py."""
    if ep <= 1:
        return 1.0
    e, k, d = args.n_experts, args.top_k, args.dim
    sampling = (e - k) / ((e - 1) * tokens * k)
    router = topk_sensitivity(e, k) ** 2 * ep / (2 * d * e)
    return 1.0 + expected_max_normal(ep) * math.sqrt(sampling + router)


def tokens_per_rank(training: Training, plan: Plan) -> float:
    """Tokens of one micro-batch a rank routes: micro_batch x seq / cp (the mixture of experts runs on the whole,
    all-gathered sequence on every tp rank); under Megatron-Core (Training.moe_layer 'megatron-core', expert tensor
    parallelism 1) each tp rank routes its sequence-parallel shard, / tp."""
    return plan.micro_batch * training.seq_len / plan.cp / moe_token_split(training, plan)


def moe_token_split(training: Training, plan: Plan) -> int:
    """How many ways tp splits the tokens a mixture of experts computes on a rank: tp under Megatron-Core's
    experts (Training.moe_layer 'megatron-core': each tp rank routes its sequence-parallel shard), else 1 (the MoE runs
    whole on every tp rank)."""
    return plan.tp if training.moe_layer == "megatron-core" else 1


def max_imbalance(args: ModelArgs, ep: int) -> float:
    """The busiest ep rank's load over the mean when every token sends as many copies to it as it can take:
    min(ep, n_experts / top_k) (every token's copies on the same experts)."""
    return min(ep, args.n_experts / args.top_k)


def imbalance(args: ModelArgs, training: Training, plan: Plan) -> float:
    """Routed copies the busiest rank of the ep group computes per MoE layer and micro-batch, over the mean: the
    stated Training.expert_imbalance, or init_imbalance; 1 without expert parallelism (a rank computes all
    experts for its own tokens)."""
    if plan.ep == 1 or not args.n_experts:
        return 1.0
    if training.expert_imbalance:
        # the stated figure is often moe/max_load, per expert (up to E / k); a rank's load cannot exceed what its
        # E / e experts can take of each token, min(k, E / e) of its k copies: min(e, E / k) x the mean
        return min(training.expert_imbalance, max_imbalance(args, plan.ep))
    return init_imbalance(args, tokens_per_rank(training, plan), plan.ep)


def kept_share(args: ModelArgs) -> float:
    """Share of the (token, expert) pairs that are computed: all (dropless), or at most capacity_factor of the mean
    per expert (GShard's capacity: an expert takes ceil(capacity_factor x T k / E) of a rank's pairs)."""
    return min(1.0, args.capacity_factor) if args.capacity_factor > 0 else 1.0


def routed_per_token(args: ModelArgs, training: Training, plan: Plan) -> float:
    """(token, expert) pairs the busiest rank computes, per token of its micro-batch: top_k x the kept share,
    times the imbalance under expert parallelism (a capacity caps what an expert takes from each rank, so the
    busiest receives at most capacity_factor x the mean)."""
    if plan.ep == 1:
        return args.top_k * kept_share(args)
    return _routed(args, training, plan.micro_batch, plan.cp, plan.ep, plan.tp)


@functools.lru_cache(maxsize=65536)
def _routed(args: ModelArgs, training: Training, micro_batch: int, cp: int, ep: int, tp: int = 1) -> float:
    # memoised on the layout fields imbalance reads: a search asks under every dp split and ZeRO stage
    load = imbalance(args, training, Plan(micro_batch=micro_batch, cp=cp, ep=ep, tp=tp))
    return args.top_k * (min(load, args.capacity_factor) if args.capacity_factor > 0 else load)


def dispatch_ranks(args: ModelArgs, training: Training, ep: int) -> float:
    """The ep ranks a token is sent to under DeepEP's dispatch (Training.moe_dispatch 'deepep'), on average: the
    stated Training.dispatch_ranks, kept within what top_k experts on ranks of E/e can touch (at least
    ceil(k e / E), at most min(e, k)); else for independent uniform routing of top_k of E experts, E/e on each
    rank, e (1 - C(E - E/e, k) / C(E, k)), the expected count of ranks holding at least one of a token's experts."""
    if ep == 1:
        return 1.0
    e, k, local = args.n_experts, args.top_k, args.n_experts // ep
    if training.dispatch_ranks:
        return max(math.ceil(k / local), min(training.dispatch_ranks, ep, k))
    return ep * (1 - math.comb(e - local, k) / math.comb(e, k))


def deepep_rows(args: ModelArgs, training: Training, ep: int, routed: float) -> float:
    """Rows per token the busiest rank receives under DeepEP's dispatch, `routed` its (token, expert) pairs per
    token (routed_per_token): each token once per destination rank (dispatch_ranks), times the same imbalance."""
    return routed * dispatch_ranks(args, training, ep) / (args.top_k * kept_share(args))


def dispatch_bytes(args: ModelArgs, training: Training, plan: Plan) -> float:
    """Bytes the busiest rank hands to one dispatch (or combine) all-to-all per MoE layer and micro-batch, in the
    compute dtype (the engine casts before it sends): its routed copies, tokens x routed_per_token x dim; under
    DeepEP's dispatch its rows (deepep_rows). (ep - 1) / ep of them leave it."""
    per_token = routed_per_token(args, training, plan)
    if training.moe_dispatch == "deepep":
        per_token = deepep_rows(args, training, plan.ep, per_token)
    return tokens_per_rank(training, plan) * per_token * args.dim * training.act_bytes


def counts_bytes(args: ModelArgs) -> float:
    """Bytes of the per-expert counts each rank exchanges first (int64, one per expert)."""
    return 8.0 * args.n_experts
