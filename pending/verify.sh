# One device call (about 4 minutes, carry .whl): main's kernels measured first, then
# pending/rms-norm-registers.patch built, every cuda test run, and measured again in the same session.
# Land the patch only if the tests pass and the A/B says so; then delete this folder.
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
bench() {
  timeout 60 python3 benchmarks/bench_kernels.py --only dense 2>&1 | grep "norm \[1,"
  timeout 60 python3 benchmarks/bench_decode.py --bits 4 --prompt 16 --profile 2>&1 | grep "head 6\|rms_norm"
}
python3 -m trellm.cli build-kernels --arch sm_90 2>&1 | tail -1
bench > $OUT/baseline.txt 2>&1; cat $OUT/baseline.txt
git apply pending/rms-norm-registers.patch || patch -p1 -s < pending/rms-norm-registers.patch
python3 -m trellm.cli build-kernels --arch sm_90 2>&1 | tail -1
timeout 150 python3 -m pytest -q -m cuda tests/ -p no:cacheprovider 2>&1 | tail -2 > $OUT/tests.txt; cat $OUT/tests.txt
bench > $OUT/patched.txt 2>&1; cat $OUT/patched.txt
