"""The planner: per-rank memory and step time of a parallel plan, a search over plans, and the reason.

Public API (what the CLI and the simulator call):

* inputs: `resolve_model`, `Training`, `accelerator` / `resolve_accelerator` / `load_profile`, `Cluster`, `Plan` (a
  shardwise.layout.Layout and its batch split; strings parse with shardwise.layout.parse_layout);
* one plan: `evaluate(args, training, plan, cluster) -> Evaluation` (itemised memory of the peak rank, StepTime),
  `stage_memory(args, training, plan, stage)` for any pipeline rank, `step_time(...)`;
* many plans: `search(args, training, cluster, fixed=..., top_k=...) -> SearchResult`, `explain(...)`.
"""

from shardwise.hardware import (
    CATALOGUE,
    Accelerator,
    Cluster,
    PlannerError,
    accelerator,
    load_profile,
    resolve_accelerator,
)
from shardwise.planner.explain import explain
from shardwise.planner.memory import (
    layer_activation_bytes,
    model_state_bytes,
    peak_memory,
    stage_memory,
    state_bytes_per_param,
)
from shardwise.planner.plan import Plan, validate_plan
from shardwise.planner.search import Evaluation, SearchResult, evaluate, plan_space, search
from shardwise.planner.timing import StepTime, step_time
from shardwise.planner.workload import Training, from_hf_config, resolve_model

__all__ = [
    "CATALOGUE", "Accelerator", "Cluster", "Evaluation", "Plan", "PlannerError", "SearchResult", "StepTime",
    "Training", "accelerator", "evaluate", "explain", "from_hf_config", "layer_activation_bytes", "load_profile",
    "model_state_bytes", "peak_memory", "plan_space", "resolve_accelerator", "resolve_model", "search",
    "stage_memory", "state_bytes_per_param", "step_time", "validate_plan",
]
