#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with .gpu/ built by scripts/gpu-build.sh.
# One phase per device call (each fits the 600 s limit of a call), logs under $OUT:
#
#   bash .gpu/gpu-run.sh tests [TEST...]  # birdtrain env, nvidia-smi, kernel check, GPU tests
#   bash .gpu/gpu-run.sh bench   # bench step vs the PyTorch peer (eager and --compile), v1 vs
#                                # v2 convolutions, bench scaling with the measured step
#   bash .gpu/gpu-run.sh train   # --gpus 1 runs: accuracy bar, --trace, exact --resume, eval
#                                # of the GPU checkpoint on the CPU, resnet50 224 px data-wait
#   bash .gpu/gpu-run.sh ncu     # ncu on the three slowest kernels, compute-sanitizer memcheck
#
# Every check prints one PASS/FAIL line into $OUT/summary.txt, shown at the end. The binary
# must find NVRTC and NCCL by itself (issue: no symlinks, no paths set by a script): `birdtrain
# env` runs first; only if it fails does the script add the wheel folders to LD_LIBRARY_PATH,
# and says so, so that the rest of the run still measures something.
# GPUS=0 runs the train phase on the CPU at small sizes: a smoke test of this script itself.
set -uo pipefail
phase=${1:-}
here=$(cd "$(dirname "$0")" && pwd)
bin=$here/birdtrain
checks="python3 $here/gpu_checks.py"
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
summary=$out/summary.txt
gpus=${GPUS:-1}
work=${WORK:-/tmp/birdtrain-gpu}; mkdir -p "$work"
export BIRDTRAIN_KERNEL_CACHE=$work/kernels

note() { echo "$*" | tee -a "$summary"; }
# check NAME CMD...: runs a gpu_checks.py line (or any command printing PASS/FAIL).
check() { "$@" 2>&1 | tee -a "$summary"; }
# step NAME SECONDS CMD...: a command with a time limit, its output in $out/NAME.log. The
# limit shrinks to what is left of the call ($DEADLINE seconds, under the device's 600), and a
# step with no time left is skipped with a line, so the summary always comes back.
deadline=${DEADLINE:-570}
step() {
  local name=$1 limit=$2; shift 2
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 15 ]; then note "SKIP $name: no time left in this call"; return 1; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  local verdict=PASS; [ $rc -eq 0 ] || verdict=FAIL
  [ $rc -eq 124 ] && verdict="FAIL (timed out after ${limit} s)"
  note "$verdict $name: exit $rc in $((SECONDS - t0)) s ($out/$name.log)"
  return $rc
}

discover() {
  "$bin" env | tee "$out/env.txt"
  "$bin" env --json >"$out/env.json" 2>&1
  local missing
  missing=$(python3 -c "
import json; r = json.load(open('$out/env.json'))
print(' '.join(k for k in ('driver', 'nvrtc', 'cuda_headers', 'kernel_compile', 'nccl') if not r[k]['ok']))")
  if [ -z "$missing" ]; then
    note "PASS discovery: driver, NVRTC, headers, a kernel compile and NCCL found by the binary alone"
    return
  fi
  note "FAIL discovery: not found by the binary alone: $missing (see $out/env.txt)"
  [ "$gpus" = 0 ] && return
  local dirs
  dirs=$(find / \( -name 'libnvrtc.so.1*' -o -name 'libnccl.so.2' \) -not -path '*/proc/*' 2>/dev/null \
    | xargs -r -n1 dirname | sort -u | paste -sd:)
  export LD_LIBRARY_PATH=$dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  note "note: continuing with LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  "$bin" env | tee "$out/env-fallback.txt"
}

phase_tests() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
  step kernels-check 120 "$bin" kernels check --arch sm_90
  # Tests that need two GPUs skip themselves with a line saying so (grep "skipped" in the logs).
  # `gpu-run.sh tests NAME...` runs only those test binaries (the rest of an unfinished call).
  local t names=("$@")
  [ ${#names[@]} -gt 0 ] || names=(cuda_kernels cuda_step cuda_memory cuda_bench_step cuda_optim_state cuda_sync_bn train_gpu dist_gpu)
  for t in "${names[@]}"; do
    step "test-$t" 150 "$here/$t" --ignored --test-threads 1
    grep -E "^test |test result|skipped" "$out/test-$t.log" | tail -40
  done
}

phase_bench() {
  local m
  for m in resnet50 resnet18; do
    step "bench-$m" 150 "$bin" bench step --model $m --batch-size 256 --json --breakdown
    tail -1 "$out/bench-$m.log" >>"$out/bench.jsonl"
    step "peer-$m" 120 python3 "$here/torch_resnet_step.py" --model $m --batch-size 256
    tail -1 "$out/peer-$m.log" >>"$out/bench.jsonl"
  done
  step peer-resnet50-compile 240 python3 "$here/torch_resnet_step.py" --model resnet50 --batch-size 256 --compile
  tail -1 "$out/peer-resnet50-compile.log" >>"$out/bench.jsonl"
  BIRDTRAIN_CONV=v1 step bench-resnet50-conv-v1 150 "$bin" bench step --model resnet50 --batch-size 256 --json --breakdown
  $checks bench "$out/bench.jsonl" | tee -a "$summary"
  local ms
  ms=$(python3 -c "import json; print(json.loads(open('$out/bench-resnet50.log').read().strip().splitlines()[-1])['ms_per_step'])" 2>/dev/null)
  if [ -n "$ms" ]; then
    step scaling 120 "$bin" bench scaling --model resnet50 --batch-size 256 --step-ms "$ms" --json "$out/scaling.json"
    tail -20 "$out/scaling.log"
  fi
}

phase_train() {
  # The CPU accuracy test's set and model (tests/train_accuracy.rs), then resnet50 at 224 px.
  local size=32 model=resnet8 big=224 bigmodel=resnet50 per=640 bs=256
  [ "$gpus" = 0 ] && { big=32; bigmodel=resnet8; per=64; bs=32; }
  local d=$work/synth64 r=$work/runs c=$work/cache
  rm -rf "$r"; mkdir -p "$r"
  [ -d "$d/train" ] || "$bin" synth --out "$d" --classes 10 --train-per-class 100 --valid-per-class 20 --size 64x64 --format png >/dev/null
  local common=(--data "$d" --gpus "$gpus" --model "$model" --image-size "$size" --cache-dir "$c" --seed 5)
  # The CPU test's accuracy bar (>= 0.90 in 5 epochs), with a trace.
  step train-accuracy 200 "$bin" "${common[@]}" --epochs 5 --out "$r/acc" --trace "$out/trace.json"
  tail -12 "$out/train-accuracy.log"
  check $checks accuracy "$r/acc" 0.90
  check $checks trace "$out/trace.json" "$([ "$gpus" = 0 ] && echo cpu || echo gpu)"
  # The GPU checkpoint evaluated by `birdtrain eval` (the CPU backend).
  step eval-cpu 120 "$bin" eval --checkpoint "$r/acc" --data "$d" --split valid --cache-dir "$c"
  check $checks eval-match "$r/acc" "$out/eval-cpu.log" 0.02
  # --resume continues exactly: 2 epochs straight vs 1 epoch, then resumed to 2.
  step resume-straight 150 "$bin" "${common[@]}" --epochs 2 --out "$r/straight"
  step resume-first 100 "$bin" "${common[@]}" --epochs 1 --out "$r/split"
  step resume-second 100 "$bin" --resume "$r/split" "${common[@]}" --epochs 2
  check $checks same-weights "$r/straight" "$r/split"
  # kill -9 just after a checkpoint inside epoch 1 (--save-every 10: the second one, step 20),
  # then --resume: the same weights again.
  step resume-killed 100 bash -c 'BIRDTRAIN_FAULT=checkpoint:cleanup@2 "$0" "$@"; [ $? -eq 137 ]' \
    "$bin" "${common[@]}" --epochs 2 --save-every 10 --out "$r/killed"
  step resume-after-kill 150 "$bin" --resume "$r/killed" "${common[@]}" --epochs 2
  check $checks same-weights "$r/straight" "$r/killed"
  # resnet50 at 224 px, warm cache: the last epoch's data-wait.
  local b=$work/synth$big
  [ -d "$b/train" ] || "$bin" synth --out "$b" --classes 8 --train-per-class $per --valid-per-class 16 --size 256x256 >/dev/null
  step datawait-$bigmodel 300 "$bin" --data "$b" --gpus "$gpus" --model $bigmodel --image-size $big \
    --batch-size $bs --epochs 3 --cache-dir "$c" --out "$r/big"
  tail -8 "$out/datawait-$bigmodel.log"
  check $checks data-wait "$out/datawait-$bigmodel.log" 1
}

phase_ncu() {
  step ncu-find 150 "$bin" bench step --model resnet50 --batch-size 256 --warmup 3 --steps 5 --json --breakdown
  local k
  for k in $($checks top-kernels "$out/ncu-find.log" 3); do
    # Four steps run; a kernel of the top three runs at least once a step: skip the first three.
    step "ncu-$k" 150 ncu --kernel-name "regex:^$k\$" --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
      --section Occupancy --section MemoryWorkloadAnalysis \
      "$bin" bench step --model resnet50 --batch-size 256 --warmup 3 --steps 1
    grep -E "Duration|Throughput|Pipe|Stall|Warp Cycles|Achieved Occupancy|Registers" "$out/ncu-$k.log" | head -30
  done
  step sanitize-memcheck 200 compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$here/cuda_kernels" --ignored --test-threads 1
  tail -5 "$out/sanitize-memcheck.log"
}

case "$phase" in
  tests|bench|train|ncu) ;;
  *) echo "usage: gpu-run.sh tests|bench|train|ncu (one per device call)" >&2; exit 2 ;;
esac
: >"$summary"
note "== gpu-run.sh $phase on $(hostname) $(date -u +%FT%TZ) (GPUS=$gpus)"
discover
shift
"phase_$phase" "$@"
echo; echo "== summary ($summary)"; cat "$summary"
