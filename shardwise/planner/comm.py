"""Collective costs on a link: the alpha-beta model, and which link each mesh axis lands on.

A ring over N ranks moves a message of X bytes in N-1 steps of X/N bytes per step for a reduce-scatter or an
all-gather, and 2(N-1) steps for an all-reduce (T = 2(N-1)X / (NB): the ring all-reduce of Horovod, Sergeev &
Balso 2018); each step also pays the link latency alpha. A tree all-reduce (NCCL's double binary tree) pays
2 log2(N) latencies and moves about 2X, which wins for small messages. We take the cheaper of the two, as NCCL's
tuner does. A profile measured by `shardwise bench` replaces the model with the measured bus bandwidth at each
message size (`measured_time`).

On the catalogue's GPUs (NCCL) a collective is priced by NCCL's own cost model instead (`nccl_time`): per
algorithm (ring; tree for all-reduce) and protocol (LL, LL128, Simple) a latency of a base plus one hardware
latency per step, the steps that cross nodes at the network's, and a bandwidth, the ring's bus bandwidth times
the protocol's share of it; NCCL runs each call with the fastest (`ncclTopoGetAlgoTime`). Small messages then
cost what LL's few-microsecond steps cost, and large ones the Simple protocol's bandwidth.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from shardwise.hardware import GPU_SMS, Accelerator, Cluster, PlannerError
from shardwise.planner.plan import Plan


@dataclass(frozen=True)
class Link:
    bandwidth: float
    """Bytes/s per direction per rank, after the efficiency factor."""
    latency: float
    """Seconds per step (alpha)."""
    tier: str
    """'intra' (NVLink/PCIe inside a node), 'inter' (network) or 'local' (a group of one)."""
    curves: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    """Measured bus bandwidth by message size per collective, scaled to this tier (Accelerator.busbw_curves);
    empty: the alpha-beta model."""
    sync: float = 0.0
    """Seconds each collective adds when the ranks arrive at it from compute (Accelerator.collective_sync_s)."""
    fabric: str = ""
    """The intra-node link NCCL sees ('nvlink' or 'pcie': Accelerator.intra_node_fabric), for NCCL's cost model
    (nccl_time); '' (gloo, or a synthetic link): the alpha-beta model."""
    per_node: int = 0
    """Members of the group in each node it spans; 0: the whole group in one node."""
    sm_share: float = 0.0
    """Share of the GPU's SMs this link's ring collectives hold while they run (NCCL's CTAs, nccl_ctas); compute
    that a collective hides behind runs on the rest. 0: not modelled (Accelerator.nccl_channels unset)."""
    fewest_per_node: int = 0
    """The fewest members of one group in one node, over the cluster's groups of this shape (per_node where every
    node holds as many; fewer where groups straddle node boundaries unevenly); 0: not given (per_node)."""
    node_bandwidth: float = 0.0
    """Bytes/s per direction per rank inside a node (after the efficiency factor), on a network link, for an
    all-to-all's share that stays in the node; 0: not given."""

    def curve(self, op: str) -> tuple[tuple[int, float], ...] | None:
        return next((c for name, c in self.curves if name == op), None)


def measured_time(nbytes: float, n: int, curve: tuple[tuple[int, float], ...], factor) -> float:
    """Seconds of a collective of `nbytes` over `n` ranks from a measured bus-bandwidth curve.

    Bus bandwidth is defined so that time = factor(N) x X / busbw(X), factor 2(N-1)/N for all-reduce and (N-1)/N
    for all-gather and reduce-scatter (nccl-tests). The curve gives tau = X / busbw at its measured sizes; between
    them tau is interpolated linearly in X (locally an alpha-beta line), below the smallest it is the smallest's
    (the latency floor), beyond the largest it grows at the largest's bandwidth."""
    sizes = [s for s, _ in curve]
    taus = [s / bw for s, bw in curve]
    if nbytes <= sizes[0]:
        tau = taus[0]
    elif nbytes >= sizes[-1]:
        tau = nbytes / curve[-1][1]
    else:
        i = next(i for i, s in enumerate(sizes) if s >= nbytes)
        w = (nbytes - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
        tau = taus[i - 1] + w * (taus[i] - taus[i - 1])
    return factor(n) * tau


def _all_reduce_factor(n: int) -> float:
    return 2 * (n - 1) / n


def _half_factor(n: int) -> float:
    return (n - 1) / n


# NCCL's cost model, from its source (src/graph/tuning.cc, ncclTopoTuneModel, NCCL 2.19-2.21), in seconds: the base
# latency of a call per algorithm and protocol, and the latency of one step on NVLink, PCIe or the network.
NCCL_BASE_LATENCY = {("ring", "ll"): 6.6e-6, ("ring", "ll128"): 14.0e-6, ("ring", "simple"): 8.4e-6,
                     ("tree", "ll"): 6.8e-6, ("tree", "ll128"): 14.0e-6, ("tree", "simple"): 0.0}
NCCL_STEP_LATENCY = {
    "nvlink": {("ring", "ll"): 0.6e-6, ("ring", "ll128"): 1.9e-6, ("ring", "simple"): 3.4e-6,
               ("tree", "ll"): 0.6e-6, ("tree", "ll128"): 1.25e-6, ("tree", "simple"): 28e-6},
    "pcie": {("ring", "ll"): 1.0e-6, ("ring", "ll128"): 2.5e-6, ("ring", "simple"): 5.7e-6,
             ("tree", "ll"): 1.0e-6, ("tree", "ll128"): 1.9e-6, ("tree", "simple"): 28e-6},
    "net": {("ring", "ll"): 2.7e-6, ("ring", "ll128"): 4.0e-6, ("ring", "simple"): 14.0e-6,
            ("tree", "ll"): 5.0e-6, ("tree", "ll128"): 8.5e-6, ("tree", "simple"): 28e-6},
}
NCCL_LL_MAX_BUS_BANDWIDTH = {1: 87.7e9, 2: 39.0e9, 4: 20.4e9}
"""LL's bus bandwidth cap by nodes (1, 2, 4 or more: llMaxBws; one node: Ampere's and Hopper's, more: an x86 Intel
host's): LL's 8-byte stores with flags do not scale with the channels."""
NCCL_NET_OVERHEAD = 1e-6
"""A network post on an x86 host (getNetOverhead; 3 x for Simple): the floor of every step of a ring across nodes."""


def nccl_time(op: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds of `op` ('all_reduce', 'all_gather', 'reduce_scatter') of `nbytes` (the full buffer, as the other
    functions here take it) over `n` ranks, as NCCL's cost model prices its fastest algorithm and protocol.

    Ring: 2(N-1) steps for all-reduce, N-1 for the others; the steps that cross nodes (2 x nodes for all-reduce,
    nodes - 1 for the others) at the network's latency. Tree (all-reduce only): 2((N/nodes - 1) intra + log2(nodes)
    network) steps. Bandwidth: `link.bandwidth` (the ring's bus bandwidth) for Simple; LL sends a flag with every
    8 bytes, 1/4 of it (1/3 for a ring gather or scatter inside a node); LL128 120 of every 128 bytes, 0.92 of it
    (0.7 with one rank per node), and only on NVLink; LL at most NCCL_LL_MAX_BUS_BANDWIDTH. A tree moves 2X at
    0.92 of it (LL: / 3.8; LL128: x 7/9 in one node, 120/128 across). NCCL also caps LL128 and the tree per
    channel; we do not model channels, and at a channel count of 16 or more those caps are above the links."""
    nodes = max(1, math.ceil(n / link.per_node)) if link.per_node else 1
    per_node = n / nodes
    all_reduce_op = op == "all_reduce"
    steps = 2 * (n - 1) if all_reduce_op else n - 1
    inter_steps = (2 * nodes if nodes > 1 else 0) if all_reduce_op else nodes - 1
    intra_hw = "nvlink" if link.fabric == "nvlink" else "pcie"
    ll_cap = NCCL_LL_MAX_BUS_BANDWIDTH[1 if nodes == 1 else 2 if nodes == 2 else 4]
    best = math.inf
    for algorithm in ("ring", "tree") if all_reduce_op else ("ring",):
        for protocol in ("ll", "ll128", "simple"):
            if protocol == "ll128" and link.fabric != "nvlink":
                continue
            key = (algorithm, protocol)
            intra, inter = NCCL_STEP_LATENCY[intra_hw][key], NCCL_STEP_LATENCY["net"][key]
            if algorithm == "ring":
                if nodes > 1:  # inside a ring that crosses nodes every step waits for a network post
                    intra = max(intra, NCCL_NET_OVERHEAD * (3 if protocol == "simple" else 1))
                latency = NCCL_BASE_LATENCY[key] + (steps - inter_steps) * intra + inter_steps * inter
                bus = link.bandwidth * {"ll": 1 / 4 if nodes > 1 or all_reduce_op else 1 / 3,
                                        "ll128": 0.92 if per_node >= 2 else 0.7, "simple": 1.0}[protocol]
                if protocol == "ll":
                    bus = min(bus, ll_cap)
                seconds = latency + nbytes * steps / (n * bus)
            else:
                latency = NCCL_BASE_LATENCY[key] + 2 * ((per_node - 1) * intra + math.floor(math.log2(nodes)) * inter)
                bus = link.bandwidth * 0.92 * {"ll": 1 / 3.8, "ll128": 7 / 9 if nodes == 1 else 120 / 128,
                                               "simple": 1.0}[protocol]
                if protocol == "ll":
                    bus = min(bus, ll_cap)
                seconds = latency + 2 * nbytes / bus
            best = min(best, seconds)
    return best


def ring_all_reduce(nbytes: float, n: int, link: Link) -> float:
    """2(N-1) steps of X/N bytes: 2(N-1)(alpha + X/(N B))."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * (link.latency + nbytes / (n * link.bandwidth))


def tree_all_reduce(nbytes: float, n: int, link: Link) -> float:
    """Reduce up and broadcast down a binary tree, pipelined: 2 log2(N) latencies and 2X/B of transfer."""
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * link.latency + 2 * nbytes / link.bandwidth


def all_reduce(nbytes: float, n: int, link: Link, after_compute: bool = True) -> float:
    """The measured curve where the profile has one, else the cheaper of ring and tree; plus the link's `sync`
    when the ranks come to it from compute (`after_compute`; False for a collective issued right after
    another)."""
    if n <= 1:
        return 0.0
    curve = link.curve("all_reduce")
    sync = link.sync if after_compute else 0.0
    if curve:
        return measured_time(nbytes, n, curve, _all_reduce_factor) + sync
    if link.fabric:
        return nccl_time("all_reduce", nbytes, n, link) + sync
    return min(ring_all_reduce(nbytes, n, link), tree_all_reduce(nbytes, n, link)) + sync


def all_gather(nbytes: float, n: int, link: Link, after_compute: bool = True) -> float:
    """Gather X bytes in total (X/N from each rank): (N-1)(alpha + X/(N B)), or the measured curve (+ sync, as
    all_reduce)."""
    return _ring_half(nbytes, n, link, "all_gather", after_compute)


def reduce_scatter(nbytes: float, n: int, link: Link, after_compute: bool = True) -> float:
    """Reduce X bytes and leave X/N on each rank: the same steps as all_gather, or reduce-scatter's curve."""
    return _ring_half(nbytes, n, link, "reduce_scatter", after_compute)


def _ring_half(nbytes: float, n: int, link: Link, op: str, after_compute: bool, steps: int | None = None) -> float:
    """`steps` of the N-1 (all of them by default) on the link, plus the sync."""
    if n <= 1:
        return 0.0
    curve = link.curve("all_gather" if op == "all_to_all" else op)
    sync = link.sync if after_compute else 0.0
    share = (n - 1 if steps is None else steps) / (n - 1)
    if curve:
        return share * measured_time(nbytes, n, curve, _half_factor) + sync
    if link.fabric and op != "all_to_all":
        return nccl_time(op, nbytes, n, link) + sync
    return share * (n - 1) * (link.latency + nbytes / (n * link.bandwidth)) + sync


def all_to_all(nbytes: float, n: int, link: Link, after_compute: bool = True) -> float:
    """Each of N ranks hands X bytes to the exchange, X/N for every rank ((N-1)/N of them leave it): a pairwise
    exchange of X/N bytes a step, (alpha + X/(N B)) each (nccl-tests' alltoall bus factor is all-gather's,
    (N-1)/N). NCCL runs it as grouped sends, which its cost model for collectives does not describe: the
    alpha-beta steps. Inside a node all N-1 steps. Across nodes a rank's N-g steps to ranks of other nodes (g: its
    group's members in its node; the busiest rank is the one with the fewest, Link.fewest_per_node) go through its
    own NIC (an all-to-all "cannot aggregate the bandwidth of multiple NICs"), while the g-1 to its node's ranks go
    over NVLink at the same time: the longer of the two. With g members in every node the network's share is the
    whole time, so nccl-tests' alltoall algorithm bandwidth on M nodes comes out at M/(M-1) x the network
    bandwidth per GPU, 2x on 2 nodes (NCCL's maintainer, NVIDIA/nccl-tests issues 130 and 267; its bus bandwidth is
    that x (N-1)/N). Over PCIe (no NVLink) a GPU's node-local bytes and those bound for its NIC cross the same
    PCIe link, so all N-1 steps are timed at the node's rate too. `shardwise bench` measures no all-to-all: a
    profile's all-gather curve prices it. With uneven exchanges X is the busiest rank's."""
    g = link.fewest_per_node or link.per_node
    if link.tier != "inter" or g <= 1:
        return _ring_half(nbytes, n, link, "all_to_all", after_compute)
    network = _ring_half(nbytes, n, link, "all_to_all", after_compute, n - g)
    if not link.node_bandwidth:
        return network
    scale = link.node_bandwidth / link.bandwidth  # (a measured curve, scaled to the network tier, back to the node's)
    node = dataclasses.replace(link, bandwidth=link.node_bandwidth, curves=tuple(
        (op, tuple((size, busbw * scale) for size, busbw in curve)) for op, curve in link.curves))
    local = _ring_half(nbytes, n, node, "all_to_all", after_compute, n - 1 if link.fabric == "pcie" else g - 1)
    return max(network, local)


def p2p(nbytes: float, link: Link) -> float:
    """A send to the next rank: the receiver waits for the sender to come from its compute (`sync`)."""
    return link.latency + nbytes / link.bandwidth + link.sync


# ---------------------------------------------------------------------------------------------------
# Mesh axes to links


MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost -> innermost


def axis_span(plan: Plan, axes: tuple[str, ...]) -> tuple[int, int]:
    """(group size, stride) of the process group over contiguous mesh `axes` (innermost last)."""
    return _span((plan.pp, plan.dp_replicate, plan.dp_shard, plan.cp, plan.tp), axes)


@functools.lru_cache(maxsize=65536)
def _span(degrees: tuple[int, ...], axes: tuple[str, ...]) -> tuple[int, int]:
    by_axis = dict(zip(MESH_ORDER, degrees))
    inner = MESH_ORDER[MESH_ORDER.index(axes[-1]) + 1:]
    return math.prod(by_axis[a] for a in axes), math.prod(by_axis[a] for a in inner)


def group_link(size: int, stride: int, cluster: Cluster, acc: Accelerator | None = None,
               spread: bool = False) -> Link:
    """The link a group of `size` ranks spaced `stride` apart uses: intra-node if the whole group sits in one
    node, otherwise the network, where each rank's off-node bytes go through its own NIC. A ring collective
    (`spread`: all-gather, reduce-scatter, all-reduce) does better: NCCL runs one ring per channel and spreads the
    channels over the node's NICs (one per GPU), and each ring leaves a node once, so a group with g members in
    every node moves its inter-node bytes over g NICs at once, g x the per-GPU NIC rate per rank, up to the
    intra-node rate that the same bytes also cross (nccl-tests' multi-node bus bandwidth on 8-GPU nodes with a
    NIC per GPU approaches the node's aggregate NIC rate). Point-to-point sends (pipeline, ring attention) and
    all-to-alls are not spread; nor is a group with one member per node (stride >= gpus_per_node: data
    parallelism outside tensor parallelism of 8)."""
    return _group_link(size, stride, cluster, acc or cluster.accelerator, spread)


NCCL_CHANNELS_PER_NIC = 4
"""CTAs a ring that leaves the node runs per NIC it spreads over: NCCL's ring search puts 2 channels on each NIC
("to ensure proper overlap and no bubbles", NCCL issue 438) and runs twice the searched channels ("execution
channels are typically 2x the search channels", NCCL issue 1041)."""


def nccl_ctas(acc: Accelerator, intra: bool, rails: int) -> int:
    """CTAs (one per channel, each holding an SM) a ring collective runs: inside a node the board's channel count
    (Accelerator.nccl_channels); across nodes NCCL_CHANNELS_PER_NIC for each NIC the ring spreads over, up to that
    count. 0 where nccl_channels is not given."""
    if not acc.nccl_channels:
        return 0
    return acc.nccl_channels if intra else min(acc.nccl_channels, NCCL_CHANNELS_PER_NIC * rails)


def members_per_node(size: int, stride: int, gpus_per_node: int) -> int:
    """Members of a group of `size` ranks spaced `stride` apart that share a node."""
    return max(1, min(size, gpus_per_node // stride))


@functools.lru_cache(maxsize=65536)
def _group_link(size: int, stride: int, cluster: Cluster, acc: Accelerator, spread: bool) -> Link:
    if size <= 1:
        return Link(float("inf"), 0.0, "local")
    intra = size * stride <= cluster.gpus_per_node  # degrees are products, so groups align with node boundaries
    per_node = 0 if intra else members_per_node(size, stride, cluster.gpus_per_node)
    rails = per_node if spread and cluster.rail_collectives and not intra else 1
    sms = acc.sms or GPU_SMS.get(acc.name, 0)
    if acc.nccl_channels and not sms:
        raise PlannerError("--gpu nccl_channels", f"{acc.name} has no SM count for NCCL's CTAs to be a share of",
                           'give the profile "sms" (its streaming multiprocessors)')
    sm_share = nccl_ctas(acc, intra, rails) / sms if sms else 0.0
    if intra:
        bw = acc.intra_node_bw * acc.comm_efficiency
    else:
        bw = min(rails * acc.inter_node_bw, acc.intra_node_bw if rails > 1 else acc.inter_node_bw) * (
            acc.comm_efficiency)
    curves = ()
    if acc.busbw_curves:  # measured inside a node; the network tier keeps their shape at its own bandwidth
        scale = bw / acc.intra_node_bw
        curves = tuple((op, tuple((size, busbw * scale) for size, busbw in sorted(c.items())))
                       for op, c in sorted(acc.busbw_curves.items()))
    if intra:
        return Link(bw, acc.intra_node_latency, "intra", curves, acc.collective_sync_s, acc.intra_node_fabric,
                    sm_share=sm_share)
    return Link(bw, acc.inter_node_latency, "inter", curves, acc.collective_sync_s, acc.intra_node_fabric, per_node,
                sm_share, fewest_members(size, stride, cluster.gpus, cluster.gpus_per_node),
                acc.intra_node_bw * acc.comm_efficiency)


def fewest_members(size: int, stride: int, gpus: int, gpus_per_node: int) -> int:
    """The fewest members one group of `size` ranks spaced `stride` apart has in any node it spans, over the
    world's groups of that shape (blocks of size x stride ranks, `stride` groups interleaved in each)."""
    block_ranks = size * stride
    if stride >= gpus_per_node:
        return 1
    if block_ranks % gpus_per_node == 0 and gpus_per_node % stride == 0:
        return gpus_per_node // stride  # whole nodes, each holding the same share of every group
    fewest = size
    for block in range(0, min(gpus, math.lcm(block_ranks, gpus_per_node)), block_ranks):  # (the pattern's period)
        for offset in range(stride):
            counts: dict[int, int] = {}
            for i in range(size):
                node = (block + offset + i * stride) // gpus_per_node
                counts[node] = counts.get(node, 0) + 1
            fewest = min(fewest, *counts.values())
    return fewest


def axis_link(plan: Plan, axes: tuple[str, ...], cluster: Cluster, spread: bool = False) -> tuple[int, Link]:
    """(group size, link) of the group over `axes`; `spread` for ring collectives (group_link)."""
    size, stride = axis_span(plan, axes)
    return size, group_link(size, stride, cluster, spread=spread)


def expert_links(plan: Plan, cluster: Cluster) -> tuple[tuple[int, Link], tuple[int, Link]]:
    """((size, link) of the expert-parallel group, (size, link) of the experts' FSDP group). As the engine's mesh
    (torchtitan's) splits dp_shard x cp: ep = dp_shard_in_ep x cp, its innermost ranks (stride tp), and the experts
    are sharded over the dp_shard_mod_ep = dp_shard x cp / ep ranks outside it (stride ep x tp). Under ZeRO-0/1
    (Megatron-Core's expert parallelism, Training.moe_layer 'megatron-core', expert tensor parallelism 1) ep is the
    innermost ep ranks of the tp x cp x dp ones (its expert ranks fold the attention's tp and cp: rank order
    tp-ep-dp), stride 1, and each expert's gradients are reduced over the tp x cp x dp / ep ranks outside it
    (Layout.expert_shard_group), stride ep."""
    ep, shard = plan.ep, plan.expert_shard_group
    if plan.zero_stage < 2:
        return (ep, group_link(ep, 1, cluster)), (shard, group_link(shard, ep, cluster, spread=True))
    return (ep, group_link(ep, plan.tp, cluster)), (shard, group_link(shard, ep * plan.tp, cluster, spread=True))
