"""Compute by shape: the GEMM rate the planner gives each linear (Accelerator.matmul_eff), checked against hand
counts of tiles and waves, the roofline, a measured table's grid points, and the matmul FLOPs of a block."""

from __future__ import annotations

import dataclasses
import math

import pytest

from shardwise.hardware import Accelerator, gemm_tile_share
from shardwise.model_args import preset
from shardwise.planner import Plan, Training, accelerator
from shardwise.planner.memory import layer_params
from shardwise.planner.timing import linear_times


def test_wave_quantisation_by_hand():
    # NVIDIA's example (Matrix Multiplication Background, "Wave Quantization"): on an A100's 108 SMs a 1792 x 1792
    # output in 256 x 128 tiles is 7 x 14 = 98 tiles, one wave with 10 SMs idle; no other large tile does better
    assert gemm_tile_share(1792, 1792, 4096, 108) == pytest.approx(98 / 108)
    # 9 x 12 tiles of 256 x 128: exactly one full wave
    assert gemm_tile_share(9 * 256, 12 * 128, 4096, 108) == 1.0
    # 4096 x 4096 on an H100's 132 SMs: 512 tiles of 256 x 128 (or 1024 of 128 x 128) leave the last of 4 (or 8)
    # waves 4 SMs short; 160-row tiles pad 4096 to 4160 and take 7 waves for 832 tiles
    assert gemm_tile_share(4096, 4096, 4096, 132) == pytest.approx(512 / 528)


def test_tile_quantisation_by_hand():
    # one SM (every tile its own wave): only the tiles' padding is lost. 129 x 129 fits best in 160 x 128 tiles
    # (1 x 2 of them), against 2 x 2 of 128 x 128
    assert gemm_tile_share(129, 129, 4096, 1) == pytest.approx(129 * 129 / (160 * 256))


def test_a_grid_smaller_than_the_gpu_is_split_along_k():
    # one 128 x 128 tile with k = 8192: 16 parts of 512 fill 16 of the 108 SMs
    assert gemm_tile_share(128, 128, 8192, 108) == pytest.approx(16 / 108)
    # k too short to split: one tile on one SM
    assert gemm_tile_share(128, 128, 512, 108) == pytest.approx(1 / 108)


def test_thin_gemm_is_bound_by_memory():
    # Llama 3 70B's key projection on tp 8: (8192 tokens x 8192) @ (8192 x 128); a LoRA rank-16 adapter
    h100 = accelerator("h100")
    for m, n, k in ((8192, 128, 8192), (8192, 16, 8192)):
        flops = 2 * m * n * k
        memory_s = (m * k + k * n + m * n) * 2 / (h100.mem_bandwidth * h100.bandwidth_efficiency)
        assert memory_s > flops / (h100.peak("bf16") * h100.matmul_efficiency)  # the premise: bound by memory
        assert h100.matmul_eff(m, n, k, "bf16") == pytest.approx(flops / memory_s / h100.peak("bf16"))
    # a large square GEMM is not: the catalogue's efficiency (no SM count: no quantisation)
    assert h100.matmul_eff(8192, 8192, 8192, "bf16") == h100.matmul_efficiency
    # with the SM count given, quantisation takes its share
    with_sms = dataclasses.replace(h100, sms=132)
    assert with_sms.matmul_eff(1792, 1792, 8192, "bf16") == pytest.approx(
        h100.matmul_efficiency * gemm_tile_share(1792, 1792, 8192, 132))


def test_measured_table_is_interpolated_in_log_space():
    table = {f"{m},{n},{k}": v for (m, n, k), v in {
        (128, 128, 128): 0.2, (128, 128, 2048): 0.4, (128, 2048, 128): 0.3, (128, 2048, 2048): 0.5,
        (2048, 128, 128): 0.6, (2048, 128, 2048): 0.8, (2048, 2048, 128): 0.7, (2048, 2048, 2048): 1.0}.items()}
    cpu = Accelerator(name="cpu", memory_bytes=1e9, peak_flops={"fp32": 1e11}, mem_bandwidth=1e10,
                      intra_node_bw=1e9, inter_node_bw=1e9, host_bw=1e9, matmul_efficiency=0.9,
                      matmul_by_shape=table)
    assert cpu.matmul_eff(128, 2048, 2048, "fp32") == pytest.approx(0.9 * 0.5)  # a grid point
    mid = math.sqrt(128 * 2048)  # halfway in log2
    assert cpu.matmul_eff(mid, 128, 128, "fp32") == pytest.approx(0.9 * (0.2 + 0.6) / 2)
    assert cpu.matmul_eff(mid, mid, mid, "fp32") == pytest.approx(0.9 * sum(table.values()) / 8)
    assert cpu.matmul_eff(16, 16, 10**6, "fp32") == pytest.approx(0.9 * 0.4)  # clamped to the grid's range


@pytest.mark.parametrize("tp", [1, 4])
def test_linears_do_six_flops_per_weight_and_token(tp):
    # with one rate for every shape, a block's three GEMMs per linear add up to 6 x tokens x the rank's weights
    # (forward, input gradient, weight gradient: 2 each), the count the planner's MFU uses
    args = preset("llama3-8b")
    flat = dataclasses.replace(accelerator("h100"), mem_bandwidth=math.inf)
    training, tokens = Training(seq_len=4096, global_batch=8), 8192
    fwd, bwd_in, bwd_w = linear_times(args, training, Plan(tp=tp), flat, tokens)
    weights = layer_params(args, tp) - 2 * args.dim  # without the two norms
    rate = flat.peak(training.compute_dtype) * flat.matmul_efficiency
    assert fwd == pytest.approx(bwd_in) == pytest.approx(bwd_w) == pytest.approx(2 * tokens * weights / rate)


@pytest.mark.parametrize("grid", ["a,b", "0,128", ""])
def test_bad_matmul_grid_is_refused_before_measuring(grid, tmp_path, capsys):
    import argparse

    from shardwise.planner.bench import add_bench_arguments, run_bench

    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    out = tmp_path / "profile.json"
    assert run_bench(parser.parse_args(["--out", str(out), "--device", "cpu", "--matmul-grid", grid])) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shardwise: error: --matmul-grid") and len(err.splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("table", [{"128,128": 1.0}, {"128,128,128": 1.0, "128,128,512": 1.0, "512,128,128": 1.0},
                                   {"a,b,c": 1.0}])
def test_profile_with_a_broken_gemm_table_is_refused(table, tmp_path):
    import json

    from shardwise.planner import PlannerError, load_profile

    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"base": "h100", "matmul_by_shape": table}))
    with pytest.raises(PlannerError, match="matmul_by_shape is not a full grid"):
        load_profile(path)
    path.write_text(json.dumps({"base": "h100", "matmul_by_shape": {"128,128,128": 0.5}}))
    expected = 0.5 * accelerator("h100").matmul_efficiency  # the table scales the base's large-GEMM efficiency
    assert load_profile(path).matmul_eff(4096, 4096, 4096, "bf16") == pytest.approx(expected)


def test_large_gemm_efficiency_follows_the_published_achievable_matmul_rates():
    # Bekman's Maximum Achievable Matmul FLOPS table (bf16, TFLOP/s achieved of peak): A100 SXM 271.2 of 312, H100
    # SXM 794.5 of 989 ("H200 is the same"), B200 SXM 1745.0 of 2250, MI300X 668.4 (of the catalogue's 1,307.4).
    # The A100 keeps the catalogue's 0.70, and each of the others the same share of its own achievable rate
    a100 = 271.2 / 312
    assert accelerator("a100-80gb").matmul_efficiency == accelerator("a100-40gb").matmul_efficiency == 0.70
    for name, achieved in (("h100", 794.5 / 989), ("h200", 794.5 / 989), ("b200", 1745.0 / 2250),
                           ("mi300x", 668.4 / 1307.4)):
        assert accelerator(name).matmul_efficiency == pytest.approx(0.70 * achieved / a100, rel=2e-3), name
    assert accelerator("h100-pcie").matmul_efficiency == 0.70  # no row


@pytest.mark.parametrize("profile, key", [
    ([1, 2], "no JSON object"), ({"base": 5}, "base = 5"), ({"base": "h100", "memory_bytes": "80GB"}, "memory_bytes"),
    ({"base": "h100", "peak_flops": 1e15}, "peak_flops"),
    ({"base": "h100", "peak_flops": {"bf16": "fast"}}, "peak_flops"),
    ({"base": "h100", "busbw_curves": {"all_reduce": {"big": 1}}}, "busbw_curves"),
    ({"base": "h100", "intra_node_bw": 0}, "intra_node_bw"), ({"base": "h100", "sms": 1.5}, "sms"),
])
def test_a_profile_value_of_the_wrong_type_is_refused_naming_it(profile, key, tmp_path):
    # each of these used to raise TypeError, AttributeError, ValueError or ZeroDivisionError inside the planner
    import json

    from shardwise.planner import PlannerError, load_profile

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    with pytest.raises(PlannerError, match=f"--gpu: .*{key}"):
        load_profile(path)
