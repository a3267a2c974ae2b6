"""Run a test function on N gloo ranks (processes): see shardwise.distributed.run_distributed."""

from shardwise.distributed import run_distributed  # noqa: F401
