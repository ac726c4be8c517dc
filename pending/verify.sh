# One device call (about 5 minutes, carry .whl). Every step figure here has PDL on (the bench bug of
# 2026-12-04a kept it off before). 1) main: TRELLM_GEMV_EARLY_STAGES swept (it only matters with PDL and was
# chosen without), interleaved twice; 2) both patches applied (branch gpu-pending, in this order): their
# tests, then the step with TRELLM_PDL_SMALL=0 / 1 interleaved; 3) every cuda test. Land the patch only if its tests pass
# and the step says so; set the early-stages default from 1); then delete this folder (and branch gpu-pending).
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -m trellm.cli build-kernels --arch sm_90 2>&1 | tail -1
for r in 1 2; do for e in 0 1 2 4 16; do TRELLM_GEMV_EARLY_STAGES=$e timeout 60 python3 pending/step.py 4 "early=$e"; done; done 2>&1 | grep step | tee $OUT/early.txt
timeout 60 python3 pending/step.py 2 "main" 2>&1 | grep step | tee -a $OUT/early.txt
# Prefill, 2048 tokens: since the residual stream (4e1d032) a prefill block runs an add and an rms_norm where
# it ran one add_rms_norm (the GEMM path returns no sums), unmeasured; the README says 28,100-28,800 tokens/s.
timeout 120 python3 benchmarks/bench_decode.py --bits 4 2>&1 | grep "prefill\|(head" | tee $OUT/prefill.txt
for p in pdl-small-dependents gated-add-rows; do git apply pending/$p.patch || patch -p1 -s < pending/$p.patch; done
python3 -m trellm.cli build-kernels --arch sm_90 2>&1 | tail -1
timeout 150 python3 -m pytest -q -m cuda tests/test_cuda_fused.py tests/test_cuda_ops.py -k "attention or norm or rotary or kv or activation or matmul_add" -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/t1.txt
for r in 1 2; do for s in 0 1; do TRELLM_PDL_SMALL=$s timeout 60 python3 pending/step.py 4 "pdl_small=$s"; done; done 2>&1 | grep step | tee $OUT/small.txt
timeout 60 python3 benchmarks/bench_decode.py --bits 4 --prompt 16 --profile 2>&1 | grep -A8 "  kernel\|(head" | tee $OUT/prof.txt
timeout 200 python3 -m pytest -q -m cuda tests/ -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/all.txt
