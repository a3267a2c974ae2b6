"""Collectives by size on NCCL (planner.comm.nccl_time): NCCL's cost model, checked by hand at the sizes where
each of its algorithms and protocols wins."""

from __future__ import annotations

import dataclasses

import pytest

from shardwise.planner import Cluster, accelerator
from shardwise.planner.comm import all_gather, all_reduce, group_link, reduce_scatter

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
