# One device call (about 5 minutes, carry .whl): exl3_matmul routes 9..64 rows to the mid-size matmul
# (9..16 were the GEMV's); the batched decode step with it (TRELLM_EXL3_MID=1) against without (0:
# GEMV up to 16 rows, decode + cuBLAS above), 8B shape, 4 bpw, batch 1..64, interleaved twice.
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -m trellm.cli build-kernels --arch sm_90 2>&1 | tail -3
timeout 150 python3 -m pytest -q -m cuda tests/test_cuda_ops.py tests/test_cuda_fused.py tests/test_generator.py -k "exl3 or matmul or generator or batch" -p no:cacheprovider 2>&1 | tail -4 | tee $OUT/tests.txt
for r in 1 2; do for b in 1 8 12 16 32 64; do for mid in 0 1; do TRELLM_EXL3_MID=$mid timeout 60 python3 benchmarks/bench_step.py 4 "mid=$mid" $b; done; done; done 2>&1 | grep "step\|Error\|error" | tee $OUT/step.txt
