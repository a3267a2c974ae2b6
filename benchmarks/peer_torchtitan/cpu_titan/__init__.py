"""torchtitan configs for CPU, found by `--module cpu_titan --config <function>` (this folder on PYTHONPATH)."""
