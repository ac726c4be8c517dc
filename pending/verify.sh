# One device call (about 5 minutes): apply pending/gpu-pending.patch (clustered GEMV epilogue, shared
# accumulator above 8 rows, fused gated GEMV, attention splits in whole waves), build, run every cuda
# test with the new paths and the exl3 tests with the old ones, and measure each change against its
# knob-off baseline in the same session. Run from the repo root on the GPU machine (carry .whl). Land
# only what passes; keep a path the default only where its A/B says so.
set -x
git apply pending/gpu-pending.patch 2>/dev/null || patch -p1 -s < pending/gpu-pending.patch
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -m trellm.cli build-kernels --arch sm_90 2>&1 | tail -1
timeout 150 python3 -m pytest -q -m cuda tests/ -x -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/tests_cluster.txt
TRELLM_GEMV_CLUSTER=0 TRELLM_GEMV_SHARED_ACC=0 timeout 60 python3 -m pytest -q -m cuda tests/test_cuda_ops.py -k exl3 -x -p no:cacheprovider 2>&1 | tail -2 | tee $OUT/tests_baseline.txt
for c in 16 0; do
  TRELLM_GEMV_CLUSTER=$c timeout 45 python3 benchmarks/bench_exl3_matmul.py --ks 4 2 --ms 1 8 16 2>&1 | tee $OUT/mm_cluster$c.txt
  TRELLM_GEMV_CLUSTER=$c timeout 60 python3 benchmarks/bench_decode.py --bits 4 --prompt 16 --profile 2>&1 | tee $OUT/decode_cluster$c.txt
done
TRELLM_GEMV_SHARED_ACC=0 timeout 45 python3 benchmarks/bench_exl3_matmul.py --ks 4 --ms 16 2>&1 | tee $OUT/mm_m16_per_warp_acc.txt
for w in 1 0; do TRELLM_ATTN_WAVES=$w timeout 40 python3 benchmarks/bench_kernels.py --only attention 2>&1 | tee $OUT/attention_waves$w.txt; done
# whether the 4096->14336 GEMV launched clustered (LaunchStats: Cluster Size, Grid Size)
timeout 60 ncu --clock-control none -k regex:exl3_matmul_small -c 6 --section LaunchStats python3 pending/one_gemv.py 2>&1 | grep -E "exl3_matmul_small|Cluster Size|Grid Size" | tee $OUT/ncu_cluster.txt
