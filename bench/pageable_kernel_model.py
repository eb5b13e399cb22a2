#!/usr/bin/env python3
"""The index arithmetic of offload-cuda/src/pageable.ptx (read_pageable),
modelled in Python and checked over random alignments and lengths: every
destination byte written once with its source byte, nothing outside the
destination range written, and no load outside the aligned 4-byte words
that hold the source (so no load leaves the pages the region maps).
Runs with no GPU: `python3 bench/pageable_kernel_model.py`."""

import random


def read_pageable(src, dst, n, mem):
    out, reads, writes = {}, [], []
    head = min((16 - (dst & 15)) & 15, n)
    m = 0 if n < head + 20 else (n - head - 4) // 16
    body_end = head + 16 * m
    for j in range(head + (n - body_end)):
        b = j if j < head else body_end + (j - head)
        out[dst + b] = mem[src + b]
        writes.append(dst + b)
        reads.append(src + b)
    s0 = src + head
    shift = (s0 & 3) * 8
    for i in range(m):
        if (s0 & 15) == 0:
            for k in range(16):
                out[dst + head + 16 * i + k] = mem[s0 + 16 * i + k]
                writes.append(dst + head + 16 * i + k)
                reads.append(s0 + 16 * i + k)
        else:
            a = (s0 + 16 * i) & ~3
            w = [int.from_bytes(bytes(mem[a + 4 * t + q] for q in range(4)), "little") for t in range(5)]
            reads += list(range(a, a + 20))
            for t in range(4):
                v = (((w[t + 1] << 32) | w[t]) >> shift) & 0xFFFFFFFF
                for q in range(4):
                    out[dst + head + 16 * i + 4 * t + q] = (v >> (8 * q)) & 255
                    writes.append(dst + head + 16 * i + 4 * t + q)
    return out, reads, writes


def main():
    rng = random.Random(7)
    for _ in range(20000):
        n = rng.randint(0, 200)
        src = 1000 + rng.randint(0, 31)
        dst = 5000 + rng.randint(0, 31)
        mem = {i: rng.randint(0, 255) for i in range(src - 8, src + n + 8)}
        out, reads, writes = read_pageable(src, dst, n, mem)
        assert sorted(writes) == list(range(dst, dst + n)), (src, dst, n)
        assert all(out[dst + i] == mem[src + i] for i in range(n)), (src, dst, n)
        lo, hi = src & ~3, (src + n + 3) & ~3
        assert all(lo <= x < hi for x in reads), (src, dst, n)
    print("read_pageable model: 20,000 cases, every byte once, no load outside the source's words")


if __name__ == "__main__":
    main()
