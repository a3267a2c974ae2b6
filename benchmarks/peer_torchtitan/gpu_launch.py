"""Run torchtitan 0.2.2's trainer on a model shape it does not ship: `torchrun ... gpu_launch.py [--cpu]
<torchtitan.train arguments>`, used by benchmarks/peer_torchtitan_gpu.py.

torchtitan 0.2.2's llama3 flavors are a dict (`torchtitan.models.llama3.llama3_args`) that its train spec hands
to the trainer as is; the two flavors below are added to it before `torchtitan.train` runs, and picked with
`--model.flavor`. Nothing else of torchtitan is changed on a GPU. Why 0.2.2 and not 0.3.0: 0.3.0 imports
`DataParallelMeshDims` from `torch.distributed.fsdp`, which the lent GPU machine's torch 2.11 does not have;
0.2.2 imports and trains on it.

--cpu (the --smoke run of peer_torchtitan_gpu.py): torchtitan also trains on CPU with the device helpers of
peer_torchtitan/cpu_launch.py; its other patches are for 0.3.0 and for more than one process, and are not needed.
"""

import runpy
import sys
from pathlib import Path

# Llama 3.2 1B's shape (dim 2048, 16 blocks, 32 heads, 8 KV heads, SwiGLU inner size 8192, vocabulary 128,256,
# rope theta 5e5), with the output head untied: torchtitan's llama3 model always has its own output matrix, so
# shardwise is run with tie_embeddings = false to match, not the other way round. The inner size is torchtitan's
# formula, multiple_of x ceil(ffn_dim_multiplier x int(2 x 4 dim / 3) / multiple_of) = 256 x ceil(1.5 x 5461 /
# 256) = 8192. The vocabulary is given here and nothing in 0.2.2 replaces it with the tokenizer's (the benchmark
# trains on a 2,048-token tokenizer): the ids only index the first rows, and every row is still in each matmul.
FLAVORS = {
    "1B": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
               vocab_size=128256, rope_theta=500000),
    # --smoke: the same plumbing on a CPU; vocabulary above the tokenizer's as in the 1B case
    # (hidden: 256 x ceil(int(2 x 4 x 128 / 3) / 256) = 512)
    "smoke": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=256, vocab_size=4096,
                  rope_theta=500000),
}


def add_flavors() -> None:
    from torchtitan.models.llama3 import TransformerModelArgs, llama3_args

    for name, shape in FLAVORS.items():
        llama3_args[name] = TransformerModelArgs(**shape)


if __name__ == "__main__":
    cpu = sys.argv[1:2] == ["--cpu"]
    # first, before any torchtitan import: its ConfigManager.parse_args reads sys.argv as a default argument
    sys.argv = ["torchtitan.train"] + sys.argv[1 + cpu:]
    if cpu:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from cpu_launch import use_cpu_as_device

        use_cpu_as_device()
        # 0.2.2's `import torchtitan` already imports modules that copied the device names (parallel_dims,
        # distributed.utils, metrics) before the patch above: point their copies at it too
        import torchtitan.tools.utils as titan_utils

        for module in [m for name, m in sys.modules.items() if name.startswith("torchtitan.")]:
            if getattr(module, "device_type", None) == "cuda":
                module.device_type = titan_utils.device_type
            if hasattr(module, "device_module"):
                module.device_module = titan_utils.device_module
    add_flavors()
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
