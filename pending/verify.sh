# One device call (about 6 minutes, carry .whl): main measured first (the GEMV early-stages sweep and the
# 2 bpw step, not yet measured under the early-stages rule), then the q/k/v patch applied, built, tested
# and measured (bench_decode times RoPE inside the q/k/v launch and apart in the same run), then every cuda
# test. Land the patch only if its tests pass and the step says so; then delete this folder (and branch
# gpu-pending).
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
dec() { timeout 40 python3 benchmarks/bench_decode.py --bits $1 --prompt 16 2>&1 | grep "(head" | cut -c1-60 | sed "s/^/$2 /"; }
python3 -m trellm.cli build-kernels --arch sm_90 2>&1 | tail -1
for e in 1 0 2 16; do TRELLM_GEMV_EARLY_STAGES=$e dec 4 "main early=$e"; done
dec 2 "main"
git apply pending/qkv-rope-epilogue.patch || patch -p1 -s < pending/qkv-rope-epilogue.patch
python3 -m trellm.cli build-kernels --arch sm_90 2>&1 | tail -1
timeout 120 python3 -m pytest -q -m cuda tests/test_cuda_fused.py tests/test_cuda_ops.py -k "qkv or exl3 or rotary" -p no:cacheprovider 2>&1 | tail -3
for b in 4 2 4; do timeout 60 python3 benchmarks/bench_decode.py --bits $b --prompt 16 2>&1 | grep "own:\|(head" | cut -c1-120; done
timeout 60 python3 benchmarks/bench_decode.py --bits 4 --prompt 16 --profile 2>&1 | grep -A7 "  kernel"
timeout 150 python3 -m pytest -q -m cuda tests/ -p no:cacheprovider 2>&1 | tail -1
