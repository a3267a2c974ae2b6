"""torchtitan's llama3_debugmodel, changed only where it cannot run on CPU."""

from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3.config_registry import llama3_debugmodel


def llama3_debugmodel_cpu():
    config = llama3_debugmodel()
    for layer in config.model_spec.model.layers:
        # FlexAttention has no CPU backward: use plain causal SDPA. This drops the per-document masking of packed
        # samples (a token attends across the end-of-text into the previous document), which is also what
        # shardwise does, so the two models see the same attention.
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    # CUDA graphs do not exist on CPU
    config.training.disable_cuda_graphs = True
    return config
