"""CPU model of the clustered GEMV epilogue (pending/gpu-pending.patch): the launcher's choice of run
width and cluster shape, and the epilogue's index math. For each case it checks that every output
column of every part is written exactly once and that every distributed-shared-memory read stays
inside the cluster and inside the source block's run. Mirrors launch_matmul_mt / the kernel by hand.

    python pending/cluster_launch_model.py
"""
from __future__ import annotations

import math

WARPS = 8


def choose(ns: list[int], k: int, resident: int = 396, limit: int = 16, fit8: int = 80, kt: int = 8):
    """(slices, cols, cluster_x, cluster_y) as the launcher picks them (cluster 0, 0: not clustered)."""
    slices = math.ceil(k / 16 / (WARPS * kt))
    tiles_n = sum(n // 16 for n in ns)
    cols = max(1, min(120, math.ceil(tiles_n * slices / resident)))
    narrow = 1 if cols <= 1 else 2 if cols <= 2 else 4 if cols <= 4 else 8
    while narrow < 8 and (8 // narrow) * slices > limit:
        narrow *= 2
    if narrow < 8:
        return slices, narrow, 8 // narrow, slices
    if 2 <= slices <= limit and (cols + 7) // 8 * 8 <= min(fit8, 120):
        return slices, (cols + 7) // 8 * 8, 1, slices
    return slices, cols, 0, 0


def check(ns: list[int], k: int, m: int) -> dict:
    slices, cols, cx, cy = choose(ns, k, kt=4 if m > 8 else 8)
    assert cx * cy > 1, "not clustered"
    begin = [0]
    for n in ns:
        begin.append(begin[-1] + math.ceil(n // 16 / cols))
    assert all(b % cx == 0 for b in begin), "a cluster straddles two parts"
    written: dict[tuple[int, int, int], int] = {}
    for bxg in range(begin[-1]):
        part = max(p for p in range(len(ns)) if begin[p] <= bxg)
        block_x, tiles_n = bxg - begin[part], ns[part] // 16
        span_tile = (block_x - block_x % cx) * cols
        span_cols = min(cx * cols, tiles_n - span_tile) * 16
        assert span_cols % 128 == 0, "a span is not whole groups"
        for y in range(slices):
            rank = block_x % cx + y * cx
            for warp in range(WARPS):
                for job in range(rank * WARPS + warp, (span_cols // 128) * m, cx * cy * WARPS):
                    g, row = divmod(job, m)
                    for lane in range(32):
                        c = g * 128 + lane * 4
                        bx, lc = divmod(c, cols * 16)
                        src_begin = (block_x - block_x % cx + bx) * cols
                        assert bx < cx and lc + 4 <= (min(src_begin + cols, tiles_n) - src_begin) * 16, "read outside"
                        for i in range(4):
                            key = (part, row, span_tile * 16 + c + i)
                            written[key] = written.get(key, 0) + 1
    assert set(written) == {(p, r, c) for p, n in enumerate(ns) for r in range(m) for c in range(n)}, "missing"
    assert all(v == 1 for v in written.values()), "written twice"
    return dict(slices=slices, cols=cols, cluster=(cx, cy), blocks=begin[-1] * slices)


if __name__ == "__main__":
    cases = [([4096, 1024, 1024], 4096, 1), ([4096], 4096, 1), ([14336, 14336], 4096, 1), ([4096], 14336, 1),
             ([1024], 4096, 1), ([384], 2048, 5), ([384], 2048, 16), ([1024, 256, 384], 1024, 16),
             ([4096], 4096, 3), ([1024, 256, 384], 1024, 5)]
    for ns, k, m in cases:
        print(ns, k, m, check(ns, k, m))
    print("lm_head", [128256], 4096, choose([128256], 4096), "(0, 0: the global epilogue; rounding up would not fit)")
