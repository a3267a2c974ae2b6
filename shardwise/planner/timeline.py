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
