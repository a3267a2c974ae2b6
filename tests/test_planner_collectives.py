"""Collectives by size on NCCL (planner.comm.nccl_time): NCCL's cost model, checked by hand at the sizes where
each of its algorithms and protocols wins."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from shardwise.planner import Cluster, accelerator, evaluate
from shardwise.planner.comm import (
    all_gather,
    all_reduce,
    all_to_all,
    fewest_members,
    group_link,
    reduce_scatter,
)

US = 1e-6


def _node_link(gpu: str = "h100", gpus: int = 8, gpus_per_node: int = 8):
    return group_link(gpus, 1, Cluster(accelerator(gpu), gpus, gpus_per_node=gpus_per_node), spread=True)


def test_small_all_reduce_in_a_node_is_one_ll_ring():
    # 1 kB over 8 NVLink GPUs: the ring with LL, 6.6 us + 14 steps of 0.6 us, at a quarter of the bus bandwidth
    # (90 GB/s) up to LL's 87.7 GB/s in one node
    link = _node_link()
    bus = 450e9 * 0.80  # NVLink per direction x comm_efficiency
    assert link.bandwidth == pytest.approx(bus)
    assert all_reduce(1e3, 8, link) == pytest.approx(6.6 * US + 14 * 0.6 * US + 1e3 * 14 / (8 * 87.7e9))


def test_large_all_reduce_in_a_node_is_the_simple_ring():
    # 1 GB: Simple, 8.4 us + 14 x 3.4 us, at the full bus bandwidth: the ring formula 2(N-1)X/(NB) plus latency
    link = _node_link()
    assert all_reduce(1e9, 8, link) == pytest.approx(8.4 * US + 14 * 3.4 * US + 1e9 * 14 / (8 * link.bandwidth))
    # and all-gather / reduce-scatter: N-1 steps
    for op in (all_gather, reduce_scatter):
        assert op(1e9, 8, link) == pytest.approx(8.4 * US + 7 * 3.4 * US + 1e9 * 7 / (8 * link.bandwidth))


def test_mid_sizes_use_ll128_on_nvlink_only():
    # 4 MB: LL128 (14 us + 14 x 1.9 us, 0.92 of the bandwidth) beats both LL's quarter bandwidth and Simple's
    # latency; over PCIe NCCL does not enable LL128
    link = _node_link()
    ll128 = 14.0 * US + 14 * 1.9 * US + 4e6 * 14 / (8 * 0.92 * link.bandwidth)
    assert all_reduce(4e6, 8, link) == pytest.approx(ll128)
    pcie = _node_link("h100-pcie")
    assert pcie.fabric == "pcie"
    simple = 8.4 * US + 14 * 5.7 * US + 4e6 * 14 / (8 * pcie.bandwidth)
    ll = 6.6 * US + 14 * 1.0 * US + 4e6 * 14 / (8 * min(pcie.bandwidth / 4, 87.7e9))
    assert all_reduce(4e6, 8, pcie) == pytest.approx(min(simple, ll))


def test_small_all_reduce_across_nodes_is_a_tree():
    # 1 kB over 1,024 GPUs in 128 nodes: the tree's 2 (7 NVLink + log2(128) network) LL steps, 85 us, where a ring
    # takes 2 x 1,023 steps (2.5 ms)
    link = _node_link(gpus=1024)
    assert link.tier == "inter" and link.per_node == 8
    tree = 6.8 * US + 2 * (7 * 0.6 * US + 7 * 5.0 * US) + 2e3 / min(link.bandwidth * 0.92 / 3.8, 20.4e9)
    assert all_reduce(1e3, 1024, link) == pytest.approx(tree)
    # all-gather has no tree: its ring crosses the network 127 times, each other step waits for a network post
    ring = 6.6 * US + (1023 - 127) * 1.0 * US + 127 * 2.7 * US + 1e3 * 1023 / (1024 * min(link.bandwidth / 4, 20.4e9))
    assert all_gather(1e3, 1024, link) == pytest.approx(ring)


def test_without_a_fabric_the_alpha_beta_model_is_kept():
    # a CPU profile (gloo) or a synthetic link: 2(N-1) latencies of the accelerator's alpha
    alpha = dataclasses.replace(accelerator("h100"), intra_node_fabric="", intra_node_bw=float("inf"),
                                intra_node_latency=1.0)
    link = group_link(8, 1, Cluster(alpha, 8))
    assert all_gather(1e6, 8, link) == pytest.approx(7.0)


@pytest.mark.parametrize("nodes", [2, 4, 16])
def test_all_to_all_across_nodes_is_bound_by_the_bytes_leaving_the_node(nodes):
    """NCCL's maintainer (NVIDIA/nccl-tests issue 130): an all-to-all's intra-node share is not the bottleneck, so
    its algorithm bandwidth on M nodes is M/(M-1) x the network bandwidth per GPU (2x on 2 nodes), one NIC a rank
    (issue 267: an all-to-all "cannot aggregate the bandwidth of multiple NICs"); nccl-tests' bus bandwidth is that
    x (n-1)/n."""
    n = 8 * nodes
    cluster = Cluster(accelerator("h100"), n, gpus_per_node=8)
    link = group_link(n, 1, cluster)  # an expert-parallel group: not spread over the node's NICs
    acc = cluster.accelerator
    assert link.tier == "inter" and link.per_node == link.fewest_per_node == 8
    nic = acc.inter_node_bw * acc.comm_efficiency
    assert link.bandwidth == pytest.approx(nic)
    x = 4e9  # large: the n - 8 latencies 1% of the time at most
    t = all_to_all(x, n, link, after_compute=False)
    assert x / t == pytest.approx(nodes / (nodes - 1) * nic, rel=0.012)
    assert all_to_all(x, n, link) == pytest.approx(t + link.sync)  # the sync once
    # inside one node every peer is a step on NVLink, as before
    intra = group_link(8, 1, cluster)
    step = intra.latency + x / (8 * intra.bandwidth)
    assert all_to_all(x, 8, intra, after_compute=False) == pytest.approx(7 * step)


def _exchange(gpu: str, size: int, stride: int, gpus: int, gpus_per_node: int, x: float = 4e9) -> float:
    link = group_link(size, stride, Cluster(accelerator(gpu), gpus, gpus_per_node=gpus_per_node))
    return all_to_all(x, size, link, after_compute=False)


def test_all_to_all_prices_the_rank_with_the_fewest_node_mates():
    """By counting bytes: a rank sends X/n to each of the n-1 others; only those bound for other nodes use its NIC.
    ep 8 spaced 2 apart on 8-GPU nodes: 4 members a node, 4 peers away; ep 8 on 6-GPU nodes over 24 GPUs: the
    groups split 6 + 2, 4 + 4, 2 + 6, and a rank with one node-mate has 6 peers away."""
    h100 = accelerator("h100")
    nic, alpha = h100.inter_node_bw * h100.comm_efficiency, h100.inter_node_latency
    x = 4e9
    away = {(2, 32, 8): 4, (1, 24, 6): 6}
    for (stride, gpus, per_node), peers in away.items():
        assert _exchange("h100", 8, stride, gpus, per_node, x) == pytest.approx(peers * (alpha + x / (8 * nic)))
    # the uneven split costs more than an even one of the same size
    assert _exchange("h100", 8, 1, 24, 6) > _exchange("h100", 8, 2, 32, 8)


def test_fewest_members_matches_counting_every_group():
    """fewest_members' shortcuts (aligned groups, one period of the layout) against counting every group's members
    node by node over the whole world, on 4-, 6- and 8-GPU nodes."""
    def counted(size, stride, gpus, per_node):
        fewest = size
        for block in range(0, gpus, size * stride):
            for offset in range(stride):
                nodes = [(block + offset + i * stride) // per_node for i in range(size)]
                fewest = min(fewest, *(nodes.count(n) for n in set(nodes)))
        return fewest

    for per_node in (4, 6, 8):
        for gpus in (per_node * m for m in (2, 3, 4, 6)):
            for size in range(2, gpus + 1):
                for stride in range(1, gpus // size + 1):
                    if gpus % (size * stride) == 0 and size * stride > per_node:
                        assert fewest_members(size, stride, gpus, per_node) == counted(size, stride, gpus, per_node)


def test_all_to_all_over_pcie_shares_the_gpu_link_with_the_nic():
    """Without NVLink a GPU's bytes for its node's ranks and for its NIC cross the same PCIe link: on 2 nodes of an
    H100 PCIe (64 GB/s PCIe, 50 GB/s NIC, before efficiency) all 15/16 of X leave the GPU at the PCIe rate, longer
    than the 8/16 that leave the node at the NIC's."""
    acc = accelerator("h100-pcie")
    eff, x = acc.comm_efficiency, 4e9
    pcie = 15 * (acc.inter_node_latency + x / (16 * acc.intra_node_bw * eff))
    nic = 8 * (acc.inter_node_latency + x / (16 * acc.inter_node_bw * eff))
    assert pcie > nic
    assert _exchange("h100-pcie", 16, 1, 16, 8, x) == pytest.approx(pcie)


def test_a_measured_curve_prices_only_the_off_node_steps():
    """A profile's measured all-gather curve (its bus bandwidth, scaled to the network tier) prices the exchange:
    the n - g off-node steps of the n - 1 it would give a whole exchange."""
    acc = dataclasses.replace(accelerator("h100"), busbw_curves={"all_gather": {1 << 20: 100e9, 1 << 30: 300e9}})
    link = group_link(16, 1, Cluster(acc, 16, gpus_per_node=8))
    x = 1 << 30
    whole = 15 / 16 * x / (300e9 * link.bandwidth / acc.intra_node_bw)  # time = (n-1)/n X / busbw
    assert all_to_all(x, 16, link, after_compute=False) == pytest.approx(whole * 8 / 15)


# NCCL's SMs: a collective hidden behind compute holds its CTAs' SMs (Accelerator.nccl_channels, Link.sm_share)


def test_nccl_ctas_by_ring_topology():
    from shardwise.planner.comm import NCCL_CHANNELS_PER_NIC

    h100 = dataclasses.replace(accelerator("h100"), nccl_channels=32)
    cluster = Cluster(h100, 128)
    # inside a node: the board's channels, of the H100's 132 SMs
    assert group_link(8, 1, cluster, spread=True).sm_share == pytest.approx(32 / 132)
    # across nodes, 8 members a node: 4 CTAs on each of the 8 NICs, capped at the board's 32
    assert group_link(128, 1, cluster, spread=True).sm_share == pytest.approx(32 / 132)
    # one member a node (data parallel outside tp 8): one NIC, 4 CTAs; 2 members: 8
    assert NCCL_CHANNELS_PER_NIC == 4
    assert group_link(16, 8, cluster, spread=True).sm_share == pytest.approx(4 / 132)
    assert group_link(32, 4, cluster, spread=True).sm_share == pytest.approx(8 / 132)
    # rings bound to one NIC (rail_collectives False) take 4 however many members a node holds
    bound = Cluster(h100, 128, rail_collectives=False)
    assert group_link(128, 1, bound, spread=True).sm_share == pytest.approx(4 / 132)
    # a profile's own SM count wins over the catalogue's
    assert group_link(8, 1, Cluster(dataclasses.replace(h100, sms=100), 8), spread=True).sm_share == pytest.approx(0.32)
    # the catalogue: NCCL's init logs' channel counts over the whitepapers' SMs where a source gives them, else none
    for name, share in (("h100", 32 / 132), ("h200", 32 / 132), ("a100-80gb", 24 / 108), ("a100-40gb", 24 / 108),
                        ("b200", 0.0), ("mi300x", 0.0), ("h100-pcie", 0.0)):
        assert group_link(8, 1, Cluster(accelerator(name), 8), spread=True).sm_share == pytest.approx(share), name


def test_a_measured_overlap_is_not_charged_nccls_sms_twice(tmp_path):
    # shardwise bench measures comm_overlap with matmuls beside a collective on the GPU, NCCL's SMs included: a
    # profile over a catalogue GPU that gives its own overlap drops the catalogue's channels unless it sets them
    import json

    from shardwise.hardware import load_profile

    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({"base": "h100", "comm_overlap": 0.8}))
    assert load_profile(measured).nccl_channels == 0
    both = tmp_path / "both.json"
    both.write_text(json.dumps({"base": "h100", "comm_overlap": 0.8, "nccl_channels": 16}))
    assert load_profile(both).nccl_channels == 16
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"base": "h100", "matmul_efficiency": 0.6}))
    assert load_profile(plain).nccl_channels == 32
    # another GPU described on an H100's figures: its board's channels and SMs are its own to give; without them it
    # prices none (the H100's channels with no SM count would refuse every multi-GPU group)
    renamed = tmp_path / "renamed.json"
    renamed.write_text(json.dumps({"base": "h100-sxm", "name": "my-h100"}))
    acc = load_profile(renamed)
    assert acc.nccl_channels == 0 and group_link(8, 1, Cluster(acc, 8), spread=True).sm_share == 0.0
    same = tmp_path / "same.json"
    same.write_text(json.dumps({"base": "h100-sxm", "name": "h100"}))  # an alias of the name it keeps
    assert load_profile(same).nccl_channels == 32
    counted = tmp_path / "counted.json"
    counted.write_text(json.dumps({"base": "h100", "name": "my-h100", "sms": 132, "nccl_channels": 16}))
    assert group_link(8, 1, Cluster(load_profile(counted), 8), spread=True).sm_share == pytest.approx(16 / 132)


@pytest.mark.parametrize("layout, fields", [
    ("fsdp-mp", {"dp_replicate": 8, "zero_stage": 0}),  # replicate's bucketed all-reduce behind backward
    ("fsdp-mp", {"dp_shard": 8, "zero_stage": 3}),  # FSDP: gathers behind forward and backward, reduce-scatter
    ("fsdp-mp", {"dp_shard": 8, "zero_stage": 2}),
    ("zero", {"dp_shard": 8, "zero_stage": 2}),  # DeepSpeed's ZeRO-2 with overlap_comm: reduce-scatter behind it
])
def test_hidden_data_parallel_traffic_pays_its_sm_share(layout, fields):
    # on 8 H100s every data-parallel collective runs on one link; with NCCL's 32 CTAs modelled, each second of it
    # that hides behind compute costs 32/132 of a second: the exposed time grows by exactly that share of the hidden
    # time (total - exposed without the term), in every branch that hides traffic
    from shardwise.model_args import preset
    from shardwise.planner import Plan, Training
    from shardwise.planner.timing import dp_comm, stage_cost
    from shardwise.planner.workload import recipe_for

    args = preset("llama3-8b")
    plan = Plan(micro_batch=1, grad_accum=2, activation_checkpoint="full", **fields)
    # (DeepSpeed hides its reduction below ZeRO-3 only with overlap_comm, which needs its gradient buckets)
    buckets = {"reduce_bucket_size": 5e8, "overlap_comm": True} if layout == "zero" else {}
    training = recipe_for(Training(seq_len=4096, global_batch=16, layout=layout, **buckets), plan)
    plain = Cluster(dataclasses.replace(accelerator("h100"), nccl_channels=0), 8)
    modelled = Cluster(accelerator("h100"), 8)  # the catalogue's 32
    cost = stage_cost(args, training, plan, plain)
    total, exposed = dp_comm(args, training, plan, plain, cost)
    total2, exposed2 = dp_comm(args, training, plan, modelled, cost)
    assert total2 == total
    hidden = total - exposed
    assert hidden > 0.3 * total  # the case at hand: much of it hidden
    assert exposed2 - exposed == pytest.approx(32 / 132 * hidden)


def test_nccl_channels_without_an_sm_count_are_refused():
    from shardwise.planner import PlannerError

    unnamed = dataclasses.replace(accelerator("h100"), name="my-gpu", nccl_channels=32)
    with pytest.raises(PlannerError, match="--gpu nccl_channels") as e:
        group_link(8, 1, Cluster(unnamed, 8), spread=True)
    assert "\n" not in str(e.value)
    assert group_link(8, 1, Cluster(dataclasses.replace(unnamed, sms=132), 8), spread=True).sm_share == pytest.approx(
        32 / 132)


def test_fsdp_at_more_gpus_is_slower_per_gpu_with_nccl_sms():
    # llm-foundry's MPT-70B on 128, 256 and 512 H100s (benchmarks/planner_published.py: published 1,058, 1,035 and
    # 1,007 tokens/s per GPU): the same work per GPU, its collectives all hidden. Without NCCL's SMs the planner
    # ties the three; with them (the catalogue's H100), the longer rings of more ranks take the SMs for longer: the
    # published order
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import planner_published as pp

    runs = [r for r in pp.RUNS if r.name.startswith("foundry h100 70b s=2048 n=") and r.name.endswith("mb=8")
            and r.gpus >= 128]
    assert [r.gpus for r in runs] == [512, 256, 128]
    plain, modelled = [], []
    for run in runs:
        ev, fits = pp.given_plan(run)
        assert fits
        modelled.append(ev.time.step_time_s)
        acc = dataclasses.replace(pp.cluster_of(run).accelerator, nccl_channels=0)
        plain.append(evaluate(run.model, pp.training_of(run), ev.plan, Cluster(acc, run.gpus)).time.step_time_s)
    assert max(plain) - min(plain) < 1e-3 * min(plain)
    assert modelled[0] > modelled[1] > modelled[2] > plain[2]
