# One device call (about 5 minutes, carry .whl): the baseline (main's sources) first, then
# pending/release-fences.patch, each built and measured in the same session; then every cuda test with
# the patch. Land the patch only if the tests pass and the A/B says so; then delete this folder.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
bench() {
  timeout 60 python3 benchmarks/bench_exl3_matmul.py --ks 4 --ms 1 8 2>&1 | tail -11
  timeout 40 python3 benchmarks/bench_kernels.py --only attention 2>&1 | tail -6
  timeout 60 python3 benchmarks/bench_decode.py --bits 4 --prompt 16 --profile 2>&1 | grep -v -i warn
}
python3 -m trellm.cli build-kernels --arch sm_90 2>&1 | tail -1
bench > $OUT/baseline.txt 2>&1; cat $OUT/baseline.txt
git apply pending/release-fences.patch || patch -p1 -s < pending/release-fences.patch
python3 -m trellm.cli build-kernels --arch sm_90 2>&1 | tail -1
timeout 150 python3 -m pytest -q -m cuda tests/ -p no:cacheprovider 2>&1 | tail -2 > $OUT/tests.txt; cat $OUT/tests.txt
bench > $OUT/patched.txt 2>&1; cat $OUT/patched.txt
timeout 60 python3 benchmarks/bench_decode.py --bits 4 --prompt 16 2>&1 | grep "head 6" | tee -a $OUT/patched.txt
