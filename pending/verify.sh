# One device call (about 6 minutes, carry .whl): the mid-size EXL3 matmul (exl3_gemm_mid.cuh, 17..64 rows).
# 1) its cuda tests and every exl3 cuda test; 2) bench_exl3_matmul --routes at K = 4, 2, 8 and M = 8..64
# (GEMV, mid and decode + cuBLAS timed in one process); 3) the whole cuda suite.
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -m trellm.cli build-kernels --arch sm_90 2>&1 | tail -3
timeout 200 python3 -m pytest -q -m cuda tests/test_cuda_ops.py -k "exl3" -p no:cacheprovider -x 2>&1 | tail -15 | tee $OUT/tests_exl3.txt
timeout 200 python3 benchmarks/bench_exl3_matmul.py --routes --ks 4 2 8 --ms 1 8 16 24 32 48 64 --csv $OUT/routes.csv 2>&1 | tee $OUT/routes.txt | tail -3
timeout 240 python3 -m pytest -q -m cuda tests/ -p no:cacheprovider 2>&1 | tail -8 | tee $OUT/all.txt
