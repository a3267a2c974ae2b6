"""shardwise: train transformers that no longer fit on one device, and know why before you pay for GPUs."""

__version__ = "0.1.0"
