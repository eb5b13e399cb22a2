#!/usr/bin/env python3
"""Would slots packed for heterogeneous blocks pay? (issue 20, item 1)

An exploration behind a decision, not a check: it sized the decision
recorded in ARCHITECTURE.md (the "Not built" paragraph on packed slots,
under "The look-ahead near the crossover"). It
runs the planner's recurrence (`offload-core` `budget/ring.rs`,
`hosted_ends` without decode or host stage and without copy interference,
ported here) for Flux.1-dev's DiT (19 double blocks of 648 MiB, 38 single
blocks of 270 MiB) two ways:

- equal slots, as the ring engine has them: depth d, d + 1 slots of the
  largest streamed block; fill k waits for the compute of streamed block
  k - d - 1 (whose slot it takes);
- a byte arena of A bytes filled in ring order (two single blocks where a
  double block's slot was): fill k waits for the compute of every earlier
  fill whose bytes, with the fills after it up to k, do not fit in A.

Under each device budget M (bytes for resident blocks plus slots or
arena), two greedy searches of its own (not the planner's search), the
better taken: one starts from every block streamed and keeps resident,
one at a time, the block that shortens the predicted forward most while
the memory fits; the other starts from every block resident and streams,
one at a time, the block whose streaming predicts the shortest forward
until the memory fits; each layout takes its
best over the depths 1, 2, 3, 4, 6 and arena sizes 0.68-3.4 GB. Block
compute follows the H200 timelines' step compute (157.4, 309.4 and 817.0
ms at 4,608, 8,192 and 16,896 tokens, BENCHMARKS.md "The timeline and the
run-to-run spread"), a quadratic through them, split between double and
single blocks as the warm-up measured them (3.63 : 3.11 ms at 4,608
tokens, 9.8 : 9.1 ms near the crossover); copies at 55.2 GB/s.

Usage: arena_recurrence.py   (python3's standard library; ~10 minutes)
Prints one row per token count and budget, the ratio equal slots / arena
(above 1: the arena is faster), and the extremes last.
"""

FORWARDS = 3
DOUBLE, SINGLE = 648 * 2**20, 270 * 2**20
LINK = 55.2e9


def steady_forward(compute, copy, size, resident, depth=None, arena=None):
    """One forward once the ring wraps (the recurrence's third forward
    minus its second), seconds."""
    n = len(compute)
    streamed = [i for i in range(n) if not resident[i]]
    m = len(streamed)
    if m == 0:
        return sum(compute)
    done, filled = [], []
    t_copy = 0.0

    def fill(g):
        nonlocal t_copy
        while len(filled) <= g:
            k = len(filled)
            block = streamed[k % m]
            if arena is None:
                d = max(1, min(depth, m - 1))
                free_at = done[k - d - 1] if k > d else 0.0
            else:
                need, j = size[block], k
                while j > 0 and need + size[streamed[(j - 1) % m]] <= arena:
                    j -= 1
                    need += size[streamed[j % m]]
                free_at = done[j - 1] if j > 0 else 0.0
            t_copy = max(t_copy, free_at) + copy[block]
            filled.append(t_copy)
        return filled[g]

    t, ends = 0.0, []
    for _ in range(FORWARDS):
        for i in range(n):
            start = t if resident[i] else max(t, fill(len(done)))
            t = start + compute[i]
            if not resident[i]:
                done.append(t)
        ends.append(t)
    return ends[-1] - ends[-2]


def footprint(size, resident, depth=None, arena=None):
    """Resident blocks plus the ring's slots (or its arena), bytes."""
    streamed = [b for b, r in zip(size, resident) if not r]
    held = sum(b for b, r in zip(size, resident) if r)
    if not streamed:
        return held
    if arena is None:
        return held + (min(depth, max(len(streamed) - 1, 1)) + 1) * max(streamed)
    return held + max(arena, max(streamed))


def greedy(compute, copy, size, budget, depth=None, arena=None):
    n = len(compute)
    resident = [False] * n

    def memory(res):
        return footprint(size, res, depth, arena)

    if memory(resident) > budget:
        return None
    best = steady_forward(compute, copy, size, resident, depth, arena)
    while True:
        pick = None
        for i in range(n):
            if resident[i]:
                continue
            trial = resident[:]
            trial[i] = True
            if memory(trial) > budget:
                continue
            s = steady_forward(compute, copy, size, trial, depth, arena)
            if pick is None or s < pick[0] - 1e-12:
                pick = (s, i)
        if pick is None:
            return best
        best = pick[0]
        resident[pick[1]] = True


def shed(compute, copy, size, budget, depth=None, arena=None):
    """The other greedy: from every block resident, stream (one at a
    time) the block whose streaming predicts the shortest forward, until
    the memory fits."""
    n = len(compute)
    resident = [True] * n

    def memory(res):
        return footprint(size, res, depth, arena)

    while memory(resident) > budget:
        pick = None
        for i in range(n):
            if not resident[i]:
                continue
            trial = resident[:]
            trial[i] = False
            s = steady_forward(compute, copy, size, trial, depth, arena)
            key = (s, memory(trial))
            if pick is None or key < pick[0]:
                pick = (key, i)
        if pick is None:
            return None
        resident[pick[1]] = False
    return steady_forward(compute, copy, size, resident, depth, arena)


def best(compute, copy, size, budget, depth=None, arena=None):
    found = [
        f(compute, copy, size, budget, depth=depth, arena=arena) for f in (greedy, shed)
    ]
    found = [x for x in found if x is not None]
    return min(found) if found else None


def step_compute(tokens):
    """Quadratic through the three measured step computes, seconds."""
    pts = [(4608, 0.1574), (8192, 0.3094), (16896, 0.8170)]
    total = 0.0
    for j, (xj, yj) in enumerate(pts):
        w = yj
        for k, (xk, _) in enumerate(pts):
            if k != j:
                w *= (tokens - xk) / (xj - xk)
        total += w
    return max(total, 0.01)


def blocks(tokens):
    # The double : single compute ratio, linear between the two measured.
    r = 3.63 / 3.11 + (9.8 / 9.1 - 3.63 / 3.11) * (tokens - 4608) / (11776 - 4608)
    r = min(max(r, 9.8 / 9.1), 3.63 / 3.11)
    single = step_compute(tokens) / (19 * r + 38)
    compute = [single * r] * 19 + [single] * 38
    size = [DOUBLE] * 19 + [SINGLE] * 38
    copy = [s / LINK for s in size]
    return compute, copy, size


def main():
    rows = []
    print("| tokens | budget GB | compute ms | equal slots ms | arena ms | slots / arena |")
    print("| --- | --- | --- | --- | --- | --- |")
    for tokens in range(1024, 16897, 2048):
        compute, copy, size = blocks(tokens)
        for budget in (6e9, 9e9, 12e9, 15e9, 18e9):
            slots = [best(compute, copy, size, budget, depth=d) for d in (1, 2, 3, 4, 6)]
            arenas = [
                best(compute, copy, size, budget, arena=a)
                for a in (0.68e9, 1.0e9, 1.36e9, 1.7e9, 2.04e9, 2.72e9, 3.4e9)
            ]
            s = min(x for x in slots if x is not None)
            a = min(x for x in arenas if x is not None)
            rows.append((s / a, tokens, budget))
            print(
                f"| {tokens} | {budget / 1e9:.0f} | {sum(compute) * 1e3:.0f} | {s * 1e3:.1f} | {a * 1e3:.1f} | {s / a:.4f} |",
                flush=True,
            )
    lo, hi = min(rows), max(rows)
    print(f"arena at its best: {hi[0]:.4f} ({hi[1]} tokens, {hi[2] / 1e9:.0f} GB); at its worst {lo[0]:.4f} ({lo[1]} tokens, {lo[2] / 1e9:.0f} GB)")


if __name__ == "__main__":
    main()
