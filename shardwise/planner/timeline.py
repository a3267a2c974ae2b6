"""A pipeline schedule as a timeline: each rank's ordered forward/backward passes, placed by their dependencies.

Used to draw the schedule (`--plot`) and, in the tests, as an independent check of the closed-form bubbles.
Rank s runs its own list in order; a forward of micro-batch i on rank s waits for rank s-1's forward of i, a
backward waits for rank s+1's backward of i (the last rank's for its own forward).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    rank: int
    kind: str
    """'F' or 'B'."""
    micro_batch: int
    start: float
    end: float


def rank_order(schedule: str, p: int, m: int, rank: int) -> list[tuple[str, int]]:
    """The order in which a rank runs its passes. GPipe: all forwards, then all backwards. 1F1B (PipeDream-Flush):
    p - rank - 1 warm-up forwards, then one forward and one backward in turn, then the remaining backwards."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"timeline draws gpipe and 1f1b, not {schedule!r}")
    warmup = min(p - rank - 1, m)
    order = [("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while b < m:
        if f < m:
            order.append(("F", f))
            f += 1
        order.append(("B", b))
        b += 1
    return order


def simulate(schedule: str, p: int, m: int, t_fwd: float, t_bwd: float) -> list[Op]:
    """Start and end of every pass, each as early as its rank and its dependencies allow."""
    orders = [rank_order(schedule, p, m, r) for r in range(p)]
    done: dict[tuple[int, str, int], float] = {}
    clock = [0.0] * p
    position = [0] * p
    ops: list[Op] = []
    while any(position[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if position[r] == len(orders[r]):
                continue
            kind, i = orders[r][position[r]]
            dep = (r - 1, "F", i) if kind == "F" else ((r + 1, "B", i) if r < p - 1 else (r, "F", i))
            if kind == "F" and r == 0:
                ready = 0.0
            elif dep in done:
                ready = done[dep]
            else:
                continue
            start = max(clock[r], ready)
            end = start + (t_fwd if kind == "F" else t_bwd)
            done[(r, kind, i)] = clock[r] = end
            ops.append(Op(r, kind, i, start, end))
            position[r] += 1
            progressed = True
        if not progressed:
            raise RuntimeError("schedule deadlocks")  # cannot happen for gpipe / 1f1b orders
    return ops


def makespan(ops: list[Op]) -> float:
    return max(op.end for op in ops)


def zbv_order(p: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """The passes a rank runs under zero-bubble's V (ZB-V, Qi et al. 2024, section 6), in the order the engine
    (torch's ScheduleZBVZeroBubble) runs them: (kind, chunk, micro-batch), kind 'F' (forward), 'I' (input
    gradients) or 'W' (the deferred weight gradients), chunk 0 for the rank's stage `rank` and 1 for its stage
    2p - 1 - rank. Written here so the planner needs no torch; a test holds it to torch's own order.

    Warm-up: 2(p - rank) - 1 forwards of chunk 0, then `rank` pairs of chunk-1 and chunk-0 forwards, then
    p - rank chunk-1 forward, input and weight passes. Steady state: a chunk-0 forward (while any is left), its
    input and weight pass, then the same for chunk 1. Cool-down: `rank` pairs of input passes (weights
    deferred), p - rank chunk-0 input and weight passes, then the deferred weight passes of chunk 1 and of
    chunk 0. The order is laid out for max(2p - 1, m) micro-batches and those past m dropped."""
    n = max(2 * p - 1, m)
    ops: list[tuple[str, int, int]] = []
    f, b, w = [0, 0], [0, 0], [0, 0]  # the next micro-batch of each chunk to run F, I, W

    def run(kind: str, chunk: int) -> None:
        counter = {"F": f, "I": b, "W": w}[kind]
        ops.append((kind, chunk, counter[chunk]))
        counter[chunk] += 1

    for _ in range(2 * (p - rank) - 1):
        run("F", 0)
    for _ in range(rank):
        run("F", 1)
        run("F", 0)
    for _ in range(p - rank):
        for kind in "FIW":
            run(kind, 1)
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            run("F", 0)
        for chunk, kinds in ((0, "IW"), (1, "FIW")):
            for kind in kinds:
                run(kind, chunk)
    for _ in range(rank):
        run("I", 0)
        run("I", 1)
    for _ in range(p - rank):
        run("I", 0)
        run("W", 0)
    while w[1] < b[1]:
        run("W", 1)
    while w[0] < b[0]:
        run("W", 0)
    return [op for op in ops if op[2] < m]
