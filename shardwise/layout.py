"""The parallel layout: which layers each pipeline stage runs and which stages each rank holds.

No torch here: the engine builds its stages from these, and the planner sizes and times the same stages
without building anything.
"""

from __future__ import annotations

import itertools

from shardwise.model_args import ModelArgs

# ---------------------------------------------------------------------------------------------------
# Split: which layers each stage runs


def layer_costs(args: ModelArgs, seq_len: int) -> tuple[int, list[int], int]:
    """(embedding, each block, final norm + head): training FLOPs per token, forward + backward.

    Compute is what sets a stage's pace, so cost is FLOPs, counted as `flops_per_token` does: a block is
    6 x its matmul weights + 12 d s for attention scores and values; the head is 6 d V for its matmul plus
    the loss's softmax and its gradient (counted as 5 operations per logit) and the final norm (~8 d). The
    embedding does no matmul: its lookup and the scatter-add of its gradient are ~2 d per token, counted,
    and negligible next to a block, whereas the head is 0.6 (Llama 2, V = 32k) to 2 (Llama 3, V = 128k)
    blocks. Memory balance is the planner's concern: the first stage holds the embedding table and, under
    1F1B, the most micro-batches in flight.
    """
    d, kv = args.dim, args.n_kv_heads * args.head_dim
    block = 6 * (2 * d * d + 2 * d * kv + 3 * d * args.ffn_hidden) + 12 * d * seq_len
    head = 6 * d * args.vocab_size + 5 * args.vocab_size + 8 * d
    return 2 * d, [block] * args.n_layers, head


def stage_costs(costs: tuple[int, list[int], int], split: list[range]) -> list[int]:
    """Cost of each stage of `split`: its blocks, plus the embedding on the first and the head on the last."""
    embedding, blocks, head = costs
    out = [sum(blocks[i] for i in layers) for layers in split]
    out[0] += embedding
    out[-1] += head
    return out


def split_layers(costs: tuple[int, list[int], int], n_stages: int) -> list[range]:
    """Contiguous layer ranges, at least one layer each, minimising the largest stage cost.

    Among the splits that reach that optimum, the one with the smallest sum of squared stage costs (the
    most even). Two small dynamic programs over (stages, layers): O(n_stages x n_layers^2).
    """
    embedding, blocks, head = costs
    n = len(blocks)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot cut {n} layers into {n_stages} stages of at least one layer")
    prefix = [0, *itertools.accumulate(blocks)]

    def cost(s: int, i: int, j: int) -> int:  # stage s runs layers i..j-1
        return prefix[j] - prefix[i] + (embedding if s == 0 else 0) + (head if s == n_stages - 1 else 0)

    def solve(objective, combine, limit: float) -> list[list]:
        # best[s][j]: (value, start of stage s) for stages 0..s covering layers 0..j-1
        best = [[None] * (n + 1) for _ in range(n_stages)]
        for j in range(1, n - n_stages + 2):
            if cost(0, 0, j) <= limit:
                best[0][j] = (objective(cost(0, 0, j)), 0)
        for s in range(1, n_stages):
            for j in range(s + 1, n - n_stages + s + 2):
                options = [(combine(best[s - 1][i][0], objective(cost(s, i, j))), i)
                           for i in range(s, j) if best[s - 1][i] is not None and cost(s, i, j) <= limit]
                best[s][j] = min(options) if options else None
        return best

    bottleneck = solve(lambda c: c, max, float("inf"))[-1][n][0]
    best = solve(lambda c: c * c, lambda a, b: a + b, bottleneck)
    split, j = [], n
    for s in reversed(range(n_stages)):
        i = best[s][j][1]
        split.append(range(i, j))
        j = i
    return split[::-1]


# ---------------------------------------------------------------------------------------------------
# Place: which stages each rank runs


def stages_of_rank(schedule: str, pp: int, rank: int, stages_per_rank: int) -> list[int]:
    """Stage indices pipeline rank `rank` holds, in pipeline order: a loop, or a V for zero-bubble."""
    if schedule == "zero-bubble":
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(stages_per_rank)]
