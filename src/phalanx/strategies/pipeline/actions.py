"""The interleaved and zero-bubble schedules as lists of actions, one list per pipeline rank, and a simulator that
checks a set of lists runs to the end and times it.

An action is ``(kind, chunk, microbatch)``. The model is cut into ``pp * v`` chunks; chunk ``c`` lives on pipeline
rank ``c % pp`` (rank r holds chunks r, r + pp, r + 2 pp, ...: Megatron's layout for virtual stages). Kinds:

- ``F``: the chunk's forward of one micro-batch (its input comes from chunk c - 1, its output goes to c + 1);
- ``BW``: the whole backward (input and weight gradients at once), as 1F1B does;
- ``B``: the input-gradient part of the backward only: what chunk c - 1 waits for;
- ``W``: the weight-gradient part, which nothing waits for, so that a schedule can put it where a rank would idle.

Bubbles, for p ranks, m micro-batches, v chunks per rank and per-micro-batch times F, B, W of a whole stage:

- 1F1B: (p - 1)(F + B + W) idle on each rank, against m (F + B + W) of work;
- interleaved 1F1B (Narayanan et al. 2021): (p - 1)(F + B + W) / v, since each warm-up and cool-down hop moves a
  chunk of 1/v of the stage;
- ZB-H1 (Qi et al. 2023): (p - 1)(F + B - W), with the same peak of p micro-batches held as 1F1B: each rank defers
  its weight gradients into what would be the cool-down's idle time.

:func:`simulate` gives each rank's idle time for any costs, which is the theory the benchmark compares with.
"""

from __future__ import annotations

__all__ = ["Action", "interleaved_1f1b_order", "zb_h1_order", "schedule_orders", "simulate", "check_interleaved"]

Action = tuple[str, int, int]
"""(kind, chunk, micro-batch): kind is F, B, W or BW; chunk is the global chunk index."""


def check_interleaved(pp: int, v: int, m: int) -> None:
    """Megatron's rule for the interleaved schedule: the micro-batches go round the ranks in groups of p."""
    if m % pp:
        raise ValueError(
            f"pp_schedule='interleaved_1f1b' sends micro-batches round the {pp} pipeline ranks in groups of pp_size, "
            f"so pp_microbatches must be a multiple of pp_size={pp}; got pp_microbatches={m} (use "
            f"{max(pp, m - m % pp)} or {m + pp - m % pp}, as Megatron-LM requires)"
        )
    if v < 2:
        raise ValueError(
            f"pp_schedule='interleaved_1f1b' needs pp_virtual_stages >= 2 chunks per rank; got {v} (use "
            "pp_schedule='1f1b' for one chunk per rank)"
        )


def interleaved_1f1b_order(pp: int, v: int, m: int, rank: int) -> list[Action]:
    """Interleaved 1F1B on ``rank``: forwards go chunk by chunk in groups of ``pp`` micro-batches (depth first),
    backwards the same way from the last chunk; a warm-up of 2 (pp - rank - 1) + (v - 1) pp forwards."""
    total = m * v

    def chunk(k: int, forward: bool) -> int:
        local = (k // pp) % v
        return (local if forward else v - 1 - local) * pp + rank

    def micro(k: int) -> int:
        return (k // (pp * v)) * pp + k % pp

    warmup = min(2 * (pp - rank - 1) + (v - 1) * pp, total)
    order: list[Action] = [("F", chunk(k, True), micro(k)) for k in range(warmup)]
    for k in range(total - warmup):
        order.append(("F", chunk(warmup + k, True), micro(warmup + k)))
        order.append(("BW", chunk(k, False), micro(k)))
    order += [("BW", chunk(k, False), micro(k)) for k in range(total - warmup, total)]
    return order


def zb_h1_order(pp: int, m: int, rank: int) -> list[Action]:
    """ZB-H1 on ``rank``: 1F1B's forwards and input backwards, with the weight backward of each micro-batch right
    after its B, except that rank r holds its first r of them back; they run when the backwards run out, where 1F1B
    would idle. At most pp micro-batches are held (until their W) on every rank, as under 1F1B on rank 0."""
    warmup = min(pp - rank - 1, m)
    order: list[Action] = [("F", rank, i) for i in range(warmup)]
    next_w = 0

    def backward(i: int) -> None:
        nonlocal next_w
        order.append(("B", rank, i))
        if i >= rank:
            order.append(("W", rank, next_w))
            next_w += 1

    for k in range(m - warmup):
        order.append(("F", rank, warmup + k))
        backward(k)
    for i in range(m - warmup, m):
        backward(i)
    order += [("W", rank, i) for i in range(next_w, m)]
    return order


def schedule_orders(schedule: str, pp: int, v: int, m: int) -> list[list[Action]]:
    """Every rank's actions for one step (every rank computes all of them: each needs its neighbours' order)."""
    if schedule == "interleaved_1f1b":
        check_interleaved(pp, v, m)
        return [interleaved_1f1b_order(pp, v, m, r) for r in range(pp)]
    if schedule == "zb_h1":
        assert v == 1, "zb_h1 has one chunk per rank"
        return [zb_h1_order(pp, m, r) for r in range(pp)]
    raise AssertionError(f"no action orders for schedule {schedule!r}")


def _needs(action: Action, chunks: int) -> list[tuple[str, int, int]]:
    kind, c, i = action
    if kind == "F":
        return [("F", c - 1, i)] if c > 0 else []
    if kind in ("B", "BW"):
        return [("F", c, i)] if c == chunks - 1 else [("B", c + 1, i)]
    return [("B", c, i)]  # W after its own B


def _done_as(need: tuple[str, int, int], done: dict[tuple[str, int, int], float]) -> tuple[str, int, int] | None:
    """The finished action that satisfies ``need`` (a B is also done by a BW), or None."""
    if need in done:
        return need
    whole = ("BW", need[1], need[2])
    return whole if need[0] == "B" and whole in done else None


def simulate(
    orders: list[list[Action]], cost: dict[str, float] | list[dict[str, float]] | None = None
) -> dict[str, list[float]]:
    """Run the orders with the given cost of each kind of action (one dict for every rank, or one per rank; default
    F = B = W = 1, BW = B + W) and free messages.

    Returns each rank's ``end`` (when its last action ends), ``busy`` and ``idle`` (end of the whole step minus
    busy). Raises AssertionError if the orders cannot all finish (a rank waits for work no one will do).
    """
    pp = len(orders)
    costs = []
    for given in cost if isinstance(cost, list) else [cost or {}] * pp:
        c = {"F": 1.0, "B": 1.0, "W": 1.0, **given}
        c.setdefault("BW", c["B"] + c["W"])
        costs.append(c)
    chunks = 1 + max(c for order in orders for _, c, _ in order)
    done: dict[tuple[str, int, int], float] = {}
    pos, clock, busy = [0] * pp, [0.0] * pp, [0.0] * pp
    progressed = True
    while progressed:
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                action = orders[r][pos[r]]
                deps = [_done_as(d, done) for d in _needs(action, chunks)]
                if any(d is None for d in deps):
                    break
                start = max([clock[r], *(done[d] for d in deps if d is not None)])
                clock[r] = start + costs[r][action[0]]
                busy[r] += costs[r][action[0]]
                done[action] = clock[r]
                pos[r] += 1
                progressed = True
    stuck = [(r, orders[r][pos[r]]) for r in range(pp) if pos[r] < len(orders[r])]
    assert not stuck, f"the schedule cannot finish: ranks wait at {stuck}"
    end = max(clock)
    return {"end": clock, "busy": busy, "idle": [end - b for b in busy]}
