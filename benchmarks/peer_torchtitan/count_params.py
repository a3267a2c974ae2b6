"""Print the exact parameter count of one system's model, built on the meta device (no memory, no weights).

    <torchtitan venv>/bin/python count_params.py titan            # torchtitan's llama3 debugmodel
    <shardwise venv>/bin/python count_params.py shardwise TOML    # the model of a shardwise job file

Each system is imported only by the python of its own environment, hence a script run twice and not a function.
"""

import sys

import torch


def titan_params() -> int:
    from torchtitan.models.llama3 import model_registry

    with torch.device("meta"):
        model = model_registry("debugmodel").model.build()
    return sum(p.numel() for p in model.parameters())


def shardwise_params(config: str) -> int:
    from shardwise.config import load_config
    from shardwise.model import build_model

    model = build_model(load_config(config).model)  # on the meta device
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    print(titan_params() if sys.argv[1] == "titan" else shardwise_params(sys.argv[2]))
