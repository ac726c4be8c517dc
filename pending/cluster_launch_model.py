import math, itertools
def choose(ns, k, m, resident=396, limit=16, fit8=120, kt=8):
    slices = math.ceil(k/16/(8*kt))
    tiles_n = sum(n//16 for n in ns)
    cols = max(1, min(120, math.ceil(tiles_n*slices/resident)))
    cx = cy = 0
    if limit >= 2 and fit8 >= 8:
        narrow = 1 if cols <= 1 else 2 if cols <= 2 else 4 if cols <= 4 else 8
        while narrow < 8 and (8//narrow)*slices > limit: narrow *= 2
        if narrow < 8: cols, cx, cy = narrow, 8//narrow, slices
        elif 2 <= slices <= limit: cols, cx, cy = min(fit8, 120, (cols+7)//8*8), 1, slices
    return slices, cols, cx, cy
def simulate(ns, k, m=1, **kw):
    slices, cols, cx, cy = choose(ns, k, m, **kw)
    begin=[0]; 
    for n in ns: begin.append(begin[-1] + math.ceil(n//16/cols))
    bx_total = begin[-1]
    assert cx*cy > 1, (ns,k,"no cluster")
    assert bx_total % cx == 0 and all(b % cx == 0 for b in begin), "clusters straddle parts"
    produced = {}
    for bxg in range(bx_total):
        part = max(p for p in range(len(ns)) if begin[p] <= bxg)
        block_x = bxg - begin[part]; tiles_n = ns[part]//16
        j_begin = block_x*cols; j_end = min(j_begin+cols, tiles_n)
        for y in range(slices):
            rank = (bxg % cx) + (y % cy)*cx
            span_tile = (block_x - block_x % cx)*cols
            span_cols = min(cx*cols, tiles_n - span_tile)*16
            assert span_cols % 128 == 0
            red_stride = cols*16
            jobs = (span_cols//128)*m
            for job in range(rank*8, jobs, cx*cy*8):
              for w in range(8):
                j = job + w
                if j >= jobs or (j - rank*8) % (cx*cy*8) >= 8: continue
            # enumerate jobs per warp properly
            for warp in range(8):
                job = rank*8 + warp
                while job < jobs:
                    g, row = divmod(job, m)
                    for lane in range(32):
                        c = g*128 + lane*4
                        bx, lc = divmod(c, red_stride)
                        # source block exists in cluster and column valid in its run
                        src_block_x = block_x - block_x % cx + bx
                        sj_begin = src_block_x*cols; sj_end = min(sj_begin+cols, tiles_n)
                        assert bx < cx and lc + 4 <= (sj_end - sj_begin)*16, (ns,k,c,bx,lc)
                        col = span_tile*16 + c
                        for i in range(4):
                            key=(part,row,col+i); produced[key]=produced.get(key,0)+1
                    job += cx*cy*8
    want = {(p,r,c) for p,n in enumerate(ns) for r in range(m) for c in range(n)}
    assert set(produced) == want and all(v == 1 for v in produced.values()), "coverage"
    return dict(slices=slices, cols=cols, cx=cx, cy=cy, blocks=bx_total*slices)
for ns,k,m in [([4096,1024,1024],4096,1),([4096],4096,1),([14336,14336],4096,1),([4096],14336,1),([1024],4096,1),([128256],4096,1),([384],2048,5),([1024,256,384],1024,16),([4096],4096,3),([1024,256,384],1024,5)]:
    kt = 4 if m > 8 else 8
    try: print(ns,k,m, simulate(ns,k,m,kt=kt))
    except AssertionError as e: print(ns,k,m,"->",e)
