# One device call (about 7 minutes, carry .whl): the decode's `>> 16` shifts moved from the integer ALU to
# the FMA pipe (TRELLM_GEMV_FMA_SHIFTS = 0 / 2 / 3 / 4 of the four per 8 states at K = 4 and 8; at K = 2 of
# eight). SASS (hot column loop, K=4, 1 row, KT=8, ALU / FMA-pipe instructions): 0 = 134 / 105, 2 = 119 / 120,
# 4 = 104 / 136. 1) build the four variants at once; 2) the exl3 cuda tests with F=4; 3) the GEMV alone at
# K = 4 and 2, 1 row, per variant; 4) the decode step, 4 and 2 bpw, variants interleaved twice.
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
nvcc --version | tail -1 > $OUT/nvcc.txt
t0=$(date +%s)
for F in 2 3 4; do TRELLM_NVCC_FLAGS="-DTRELLM_GEMV_FMA_SHIFTS=$F" python3 -m trellm.cli build-kernels --arch sm_90 > $OUT/build$F.txt 2>&1 & done
python3 -m trellm.cli build-kernels --arch sm_90 2>&1 | tail -1; wait
echo "builds: $(( $(date +%s) - t0 )) s" | tee $OUT/builds.txt
TRELLM_NVCC_FLAGS="-DTRELLM_GEMV_FMA_SHIFTS=4" timeout 200 python3 -m pytest -q -m cuda tests/test_cuda_ops.py tests/test_cuda_fused.py -k "exl3 or matmul or moe" -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/tests_f4.txt
for F in 0 2 3 4; do echo "== F=$F"; TRELLM_NVCC_FLAGS="-DTRELLM_GEMV_FMA_SHIFTS=$F" timeout 90 python3 benchmarks/bench_exl3_matmul.py --ks 4 2 --ms 1 2>&1 | grep -v "^#" | tail -12; done 2>&1 | tee $OUT/gemv.txt
for r in 1 2; do for b in 4 2; do for F in 0 2 3 4; do TRELLM_NVCC_FLAGS="-DTRELLM_GEMV_FMA_SHIFTS=$F" timeout 60 python3 benchmarks/bench_step.py $b "F=$F"; done; done; done 2>&1 | grep step | tee $OUT/step.txt
