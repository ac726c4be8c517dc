# One device call (about 6 minutes, carry .whl): figures for docs/results and the README.
# 1) bench_exl3_matmul, every shape / K / M, CSV + plot; 2) bench_decode 4 and 2 bpw (step, prefill) and the
# step's kernel profile; 3) bench_generator on the GPU, random SmolLM2-shaped model, bf16, batch 1..64 + plot.
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -m trellm.cli build-kernels --arch sm_90 2>&1 | tail -1
timeout 240 python3 benchmarks/bench_exl3_matmul.py --csv $OUT/exl3_matmul_h200.csv --plot $OUT/exl3_matmul_h200.png 2>&1 | tee $OUT/matmul.txt | tail -3
timeout 150 python3 benchmarks/bench_decode.py --bits 4 2 2>&1 | grep -v "^ *$" | tail -14 | tee $OUT/decode.txt
timeout 60 python3 benchmarks/bench_decode.py --bits 4 --prompt 16 --profile 2>&1 | grep -A14 "  kernel" | tee $OUT/prof.txt
timeout 200 python3 benchmarks/bench_generator.py --random-like-smollm2 /tmp/rsmol --device cuda --dtype bfloat16 --batch-sizes 1,4,16,64 --new-tokens 128 --plot $OUT/generator_h200.png 2>&1 | tail -12 | tee $OUT/gen.txt
