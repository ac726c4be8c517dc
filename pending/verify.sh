# One device call (about 8 minutes, carry .whl): main's kernels measured first, then each patch applied,
# built and measured in turn in the same session (warp-uniform, then rms-norm-registers on top), with
# every cuda test run on the final state. Land a patch only if the tests pass and its step says so; then
# delete this folder (and branch gpu-pending).
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
bench() {
  timeout 40 python3 benchmarks/bench_kernels.py --only attention 2>&1 | grep decode
  timeout 60 python3 benchmarks/bench_kernels.py --only dense 2>&1 | grep "norm \[1,"
  timeout 60 python3 benchmarks/bench_exl3_matmul.py --ks 4 --ms 1 16 2>&1 | grep fused
  timeout 60 python3 benchmarks/bench_kv_quant.py 2>&1 | grep -v "^#" | tail -8
  timeout 60 python3 benchmarks/bench_decode.py --bits 4 --prompt 16 --profile 2>&1 | grep "head 6\|rms_norm\|paged_att\|exl3_matmul"
}
python3 -m trellm.cli build-kernels --arch sm_90 2>&1 | tail -1
bench > $OUT/0-baseline.txt 2>&1; cat $OUT/0-baseline.txt
for p in warp-uniform rms-norm-registers; do
  git apply pending/$p.patch || patch -p1 -s < pending/$p.patch
  python3 -m trellm.cli build-kernels --arch sm_90 2>&1 | tail -1
  bench > $OUT/+$p.txt 2>&1; echo "== +$p"; cat $OUT/+$p.txt
done
timeout 150 python3 -m pytest -q -m cuda tests/ -p no:cacheprovider 2>&1 | tail -3 > $OUT/tests.txt; cat $OUT/tests.txt
