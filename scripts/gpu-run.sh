#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with .gpu/ built by scripts/gpu-build.sh.
# One phase per device call (each fits the 600 s limit of a call), logs under $OUT:
#
#   bash .gpu/gpu-run.sh tests [MODULE...]  # birdtrain env, nvidia-smi, kernel check, GPU tests
#   bash .gpu/gpu-run.sh bench   # bench step vs the PyTorch peer (eager and --compile), v1 vs
#                                # v2 convolutions, bench scaling with the measured step
#   bash .gpu/gpu-run.sh train   # --gpus 1 runs: accuracy bar, --trace, exact --resume, eval
#                                # of the GPU checkpoint on the CPU, resnet50 224 px data-wait
#   bash .gpu/gpu-run.sh auto    # --batch-size auto: resnet50 at 224 px trains at the batch picked
#   bash .gpu/gpu-run.sh syncbn  # a resnet50 224 px epoch with --sync-bn against without (images/s),
#                                # and 128 × 2 accumulated against 128 and 256 (--grad-accum-steps)
#   bash .gpu/gpu-run.sh ncu     # ncu on the three slowest kernels, compute-sanitizer memcheck
#   bash .gpu/gpu-run.sh multi   # several ranks on the one GPU (< 6 min, most important first):
#                                # N ranks rehearsed in one process (BIRDTRAIN_REHEARSE_RANKS),
#                                # NCCL between two processes, torchrun (standalone, restart)
#   bash .gpu/gpu-run.sh fusion  # batch norm fused into the convolutions (< 7 min; the default,
#                                # BIRDTRAIN_BN_FUSION=0 turns it off; this phase sets it where
#                                # it wants it): the fused ops and the resnet18 step against the CPU,
#                                # twice to the bit, synchronised BN fused, then resnet50 and
#                                # resnet18 steps fused and separate with --breakdown, then
#                                # resnet50's in three alternating rounds without it
#   bash .gpu/gpu-run.sh prologue  # the inner batch norms applied by the convolutions that read
#                                # them (BIRDTRAIN_BN_PROLOGUE=1, off by default; < 4 min): the
#                                # applied ops and steps against the stored ones to the bit, then
#                                # resnet50 on and off in three alternating rounds, a breakdown each
#   bash .gpu/gpu-run.sh tta     # time to accuracy on Fashion-MNIST (< 8 min): birdtrain and the
#                                # PyTorch peer (torch.compile, bf16) train resnet20 with one
#                                # recipe to test accuracy 0.93 (benches/fashion_mnist/README.md)
#   bash .gpu/gpu-run.sh python  # the Python package (birdtrain.Loader) on the GPU (< 3 min): its
#                                # wheel pip-installed into a folder of its own, its gpu-marked
#                                # pytest tests against the machine's PyTorch (device="cuda",
#                                # side-stream copies, page-locked engine buffers)
#   bash .gpu/gpu-run.sh hopper  # the v3 convolutions (kernels/conv3.cu, wgmma + TMA; < 6 min):
#                                # sm_90a compile and report, their GPU tests against the CPU
#                                # (ops, fused batch norm, a resnet50 step), compute-sanitizer,
#                                # then resnet50 v3 against v2 in three alternating rounds and
#                                # once with --breakdown
#   bash .gpu/gpu-run.sh graphs  # the training step as a CUDA graph (BIRDTRAIN_CUDA_GRAPH=1, off by
#                                # default; < 4 min): replay against eager to the bit (library
#                                # level, and the trainer with augmentation, mixup/CutMix, AdamW,
#                                # a partial last batch), resnet50 b256's step eager and replayed
#   bash .gpu/gpu-run.sh next    # what has never run on a GPU, in one call (< 6 min): the v3
#                                # kernels, the CUDA graphs, the applied batch norms and the
#                                # Python package checked side by side, then v3 against v2, the
#                                # graph step and the applied batch norms timed alone
#   bash .gpu/gpu-run.sh verify  # after a change of the default path (< 4 min): every GPU test
#                                # module side by side, the Python package, the default step
#   bash .gpu/gpu-run.sh timing  # issue 31's timed work alone (< 5 min): v3 against v2, breakdowns,
#                                # resnet18, the PyTorch peer eager and compiled
#   bash .gpu/gpu-run.sh tiles   # v3's persistent kernels (BIRDTRAIN_CONV3_TILES) and recomputed
#                                # masks (BIRDTRAIN_BN_MASK; < 7 min): the step under each to the
#                                # bit, then the settings in alternating rounds and breakdowns
#   bash .gpu/gpu-run.sh tiles,all  # several phases in turn in one call, under one DEADLINE
#   bash .gpu/gpu-run.sh all     # all of them in one call, for a short lease: the correctness
#                                # work side by side on the shared GPU (no timing is read
#                                # there), then the timed work alone, most important first
#
# Logs go to $LOGS (default /tmp/gpu-out); when $OUT is set (the device tool, which brings
# back at most 8 files) they come back packed as $OUT/logs.tgz, with $OUT/summary.txt.
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
out=${LOGS:-/tmp/gpu-out}; mkdir -p "$out"
# Pack the logs for the device tool however the call ends (a step's own limit keeps it short).
pack() {
  [ -n "${OUT:-}" ] || return 0
  cp "$summary" "$OUT/summary.txt" 2>/dev/null
  tar czf "$OUT/logs.tgz" -C "$out" . 2>/dev/null
}
trap pack EXIT
summary=$out/summary.txt
gpus=${GPUS:-1}
work=${WORK:-/tmp/birdtrain-gpu}; mkdir -p "$work"
export BIRDTRAIN_KERNEL_CACHE=$work/kernels
# The binary for the tests that start it (they run away from their build tree here).
export BIRDTRAIN_BIN=$bin

# The GPU test binary (scripts/gpu-build.sh builds it) and its modules, each run on its own
# (`$test_bin MODULE::` runs that module's tests); cuda_memory fills the GPU's memory, so `all`
# runs it alone, after the others.
test_bin=$here/gpu
gpu_tests=(cuda_kernels cuda_step cuda_memory cuda_bench_step cuda_optim_state cuda_sync_bn train_gpu
  train_gpu_accum train_gpu_ranks dist_gpu)
shared_tests=()
for t in "${gpu_tests[@]}"; do [ "$t" = cuda_memory ] || shared_tests+=("$t"); done

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
print(' '.join(k for k in ('driver', 'nvrtc', 'cuda_headers', 'kernel_compile', 'nccl') if not r[k]['ok']))" 2>/dev/null \
    || echo "everything (no readable 'birdtrain env --json')")
  if [ -z "$missing" ]; then
    note "PASS discovery: driver, NVRTC, headers, a kernel compile and NCCL found by the binary alone"
    # And where the loader's own path is empty (a shell without the image's LD_LIBRARY_PATH):
    # the search of CUDA_HOME, the toolkit and python3's site-packages must find them.
    env -u LD_LIBRARY_PATH "$bin" env >"$out/env-no-ld-path.txt" 2>&1
    note "without LD_LIBRARY_PATH: $(grep -E '^(nvrtc|nccl|kernel compile) ' "$out/env-no-ld-path.txt" | tr -s ' ' | paste -sd';')"
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
  # Tests that need two GPUs skip themselves with a line saying so; --nocapture keeps that line
  # (and the tests' measured figures) in the logs: grep "skipped".
  # `gpu-run.sh tests MODULE...` runs only those modules (the rest of an unfinished call).
  local t names=("$@")
  [ ${#names[@]} -gt 0 ] || names=("${gpu_tests[@]}")
  for t in "${names[@]}"; do
    step "test-$t" 150 "$test_bin" --ignored --test-threads 1 --nocapture "$t::"
    grep -E "^test |test result|skipped" "$out/test-$t.log" | tail -40
  done
}

phase_bench() {
  bench_pair resnet50
  bench_pair resnet18
  bench_compiled_peer
  BIRDTRAIN_CONV=v1 step bench-resnet50-conv-v1 150 "$bin" bench step --model resnet50 --batch-size 256 --json --breakdown
  bench_scaling
}

# birdtrain's step and the PyTorch peer's (eager), one after the other, for model $1.
# $BENCH_STEPS: birdtrain's timed steps (default 50, after 15 warm-up steps).
bench_pair() {
  local m=$1 steps=${BENCH_STEPS:-50}
  step "bench-$m" 150 "$bin" bench step --model $m --batch-size 256 --json --breakdown \
    --warmup $(( steps < 15 ? 5 : 15 )) --steps "$steps"
  tail -1 "$out/bench-$m.log" >>"$out/bench.jsonl"
  step "peer-$m" 120 python3 "$here/torch_resnet_step.py" --model $m --batch-size 256
  tail -1 "$out/peer-$m.log" >>"$out/bench.jsonl"
  $checks bench "$out/bench.jsonl" | tee -a "$summary"
}

bench_compiled_peer() {
  step peer-resnet50-compile 240 python3 "$here/torch_resnet_step.py" --model resnet50 --batch-size 256 --compile
  tail -1 "$out/peer-resnet50-compile.log" >>"$out/bench.jsonl"
  $checks bench "$out/bench.jsonl" | tee -a "$summary"
}

# bench scaling with the measured resnet50 step.
bench_scaling() {
  local ms
  ms=$(python3 -c "import json; print(json.loads(open('$out/bench-resnet50.log').read().strip().splitlines()[-1])['ms_per_step'])" 2>/dev/null)
  if [ -n "$ms" ]; then
    step scaling 120 "$bin" bench scaling --model resnet50 --batch-size 256 --step-ms "$ms" --json "$out/scaling.json"
    tail -20 "$out/scaling.log"
  fi
}

phase_train() {
  train_checks
  big_set
  train_data_wait
  sync_bn_cost
}

phase_syncbn() {
  big_set
  sync_bn_cost
  accum_cost
}

# --sync-bn against without: resnet50 at 224 px on the data-wait run's set and cache, two
# epochs each, the last (warm) epoch's training images/s compared. On one GPU, NCCL has one
# rank, so this is what the sync-BN path itself costs (a second BN pass forward, its kernels,
# one-rank sums on the side communicator and stream, no host round trip), not the overlap with
# the buckets that several GPUs would show. The sync-BN run logs at info level, so the check
# can see that its sums ran on the side communicator.
sync_bn_cost() {
  [ "$gpus" = 0 ] && { note "SKIP sync-bn-cost: needs a GPU (the CPU has no side communicator)"; return; }
  local b=$work/synth-big r=$work/runs-syncbn c=$work/cache
  rm -rf "$r"; mkdir -p "$r"
  local common=(--data "$b" --gpus "$gpus" --model resnet50 --image-size 224 --batch-size 128
    --epochs 2 --cache-dir "$c")
  step syncbn-plain 120 "$bin" "${common[@]}" --out "$r/plain"
  RUST_LOG=birdtrain=info step syncbn-synced 120 "$bin" "${common[@]}" --sync-bn --out "$r/synced"
  grep -E "^epoch " "$out/syncbn-plain.log" "$out/syncbn-synced.log"
  check $checks sync-bn-cost "$out/syncbn-synced.log" "$out/syncbn-plain.log"
}

# The CPU accuracy test's set and model (tests/train/accuracy.rs): accuracy, trace, eval on
# the CPU, exact resume (also after kill -9).
train_checks() {
  local size=32 model=resnet8
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
  # The same run again: the same bits (no kernel of the v2 path adds with atomics).
  step repeat-straight 150 "$bin" "${common[@]}" --epochs 2 --out "$r/again"
  check $checks same-weights "$r/straight" "$r/again" repeat
  step resume-first 100 "$bin" "${common[@]}" --epochs 1 --out "$r/split"
  step resume-second 100 "$bin" --resume "$r/split" "${common[@]}" --epochs 2
  check $checks same-weights "$r/straight" "$r/split"
  # kill -9 just after a checkpoint inside epoch 1 (--save-every 10: the second one, step 20),
  # then --resume: the same weights again.
  step resume-killed 100 bash -c 'BIRDTRAIN_FAULT=checkpoint:cleanup@2 "$0" "$@"; [ $? -eq 137 ]' \
    "$bin" "${common[@]}" --epochs 2 --save-every 10 --out "$r/killed"
  step resume-after-kill 150 "$bin" --resume "$r/killed" "${common[@]}" --epochs 2
  check $checks same-weights "$r/straight" "$r/killed"
}

# The set for the data-wait run: 8 classes x 640 images of 256 px (CPU only; GPUS=0: small).
big_set() {
  local per=640; [ "$gpus" = 0 ] && per=64
  local b=$work/synth-big
  [ -d "$b/train" ] || "$bin" synth --out "$b" --classes 8 --train-per-class $per --valid-per-class 16 --size 256x256 >/dev/null
}

# resnet50 at 224 px, warm cache: the last epoch's data-wait (GPUS=0: resnet8 at 32 px).
train_data_wait() {
  local big=224 bigmodel=resnet50 bs=256
  [ "$gpus" = 0 ] && { big=32; bigmodel=resnet8; bs=32; }
  local b=$work/synth-big r=$work/runs-big c=$work/cache
  rm -rf "$r"; mkdir -p "$r"
  step datawait-$bigmodel 300 "$bin" --data "$b" --gpus "$gpus" --model $bigmodel --image-size $big \
    --batch-size $bs --epochs 3 --cache-dir "$c" --out "$r/big"
  tail -8 "$out/datawait-$bigmodel.log"
  check $checks data-wait "$out/datawait-$bigmodel.log" 1
}

# --batch-size auto with resnet50 at 224 px: the batch it measures for the GPU trains (one
# epoch of 1 280 images; with GPUS=0 the flag is refused, so the step is skipped).
phase_auto() {
  [ "$gpus" = 0 ] && { note "SKIP auto-batch: --batch-size auto needs a GPU"; return; }
  local b=$work/synth-auto r=$work/runs-auto c=$work/cache
  [ -d "$b/train" ] || "$bin" synth --out "$b" --classes 8 --train-per-class 160 --valid-per-class 8 --size 256x256 >/dev/null
  rm -rf "$r"; mkdir -p "$r"
  step auto-batch-resnet50 150 "$bin" --data "$b" --gpus "$gpus" --model resnet50 --image-size 224 \
    --batch-size auto --epochs 1 --cache-dir "$c" --out "$r/auto"
  grep -E "batch-size auto|global batch|wall time" "$out/auto-batch-resnet50.log" | tee -a "$summary"
}

phase_ncu() {
  step ncu-find 150 "$bin" bench step --model resnet50 --batch-size 256 --warmup 3 --steps 5 --json --breakdown
  ncu_top "$out/ncu-find.log"
  sanitize
}

# ncu on the three kernels with the most time in the --breakdown line of log $1.
ncu_top() {
  local k
  for k in $($checks top-kernels "$1" 3); do
    # Four steps run; a kernel of the top three runs at least once a step: skip the first three.
    step "ncu-$k" 150 ncu --kernel-name "regex:^$k\$" --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
      --section Occupancy --section MemoryWorkloadAnalysis \
      "$bin" bench step --model resnet50 --batch-size 256 --warmup 3 --steps 1
    grep -E "Duration|Throughput|Pipe|Stall|Warp Cycles|Achieved Occupancy|Registers" "$out/ncu-$k.log" | head -30
  done
}

sanitize() {
  step sanitize-memcheck 200 compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$test_bin" --ignored --test-threads 1 cuda_kernels::
  tail -5 "$out/sanitize-memcheck.log"
}

# Several ranks on the one GPU (ARCHITECTURE.md, "Rehearsing N GPUs on one GPU"), most important
# first: the rehearsal of N ranks in one process, then NCCL between two processes, then torchrun.
# One PASS/FAIL line per test (gpu_checks.py tests): a test that skips for want of a GPU or NCCL
# fails here.
phase_multi() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
  step test-ranks 200 "$test_bin" --ignored --test-threads 1 --show-output train_gpu_ranks::ranks_
  $checks tests "$out/test-ranks.log" train_gpu_ranks::ranks_ 7 | tee -a "$summary"
  step test-nccl 150 "$test_bin" --ignored --test-threads 1 --show-output train_gpu_ranks::nccl_
  $checks tests "$out/test-nccl.log" train_gpu_ranks::nccl_ 2 | tee -a "$summary"
  torchrun_checks
}

# torchrun (PyTorch's launcher, `python3 -m torch.distributed.run`) starting birdtrain without
# --gpus: a standalone one-process run trains on the GPU; with --max-restarts 1, kill -9 of the
# worker after its first checkpoint makes torchrun restart it, and the restarted worker resumes
# the run in --out (TORCHELASTIC_RESTART_COUNT > 0) to the last epoch.
torchrun_checks() {
  local launcher=(python3 -m torch.distributed.run --standalone --nproc-per-node 1)
  if ! python3 -c "import torch.distributed.run" >"$out/torchrun-import.log" 2>&1; then
    note "FAIL torchrun: python3 cannot import torch.distributed.run ($out/torchrun-import.log)"
    return
  fi
  local d=$work/synth-multi r=$work/runs-multi c=$work/cache-multi
  rm -rf "$r"; mkdir -p "$r"
  [ -d "$d/train" ] || "$bin" synth --out "$d" --classes 4 --train-per-class 60 --valid-per-class 4 --size 32x32 --format png >/dev/null
  local common=(--data "$d" --model resnet8 --image-size 32 --batch-size 16 --cache-dir "$c" --seed 5)
  step torchrun-standalone 90 "${launcher[@]}" --no-python "$bin" "${common[@]}" --epochs 2 --out "$r/standalone"
  check $checks torchrun "$r/standalone" "$out/torchrun-standalone.log" 2
  step torchrun-restart 150 bash "$here/gpu-run.sh" torchrun-kill "$r/restart" \
    "${launcher[@]}" --max-restarts 1 --no-python "$bin" "${common[@]}" --epochs 6 --save-every 5 --out "$r/restart"
  check $checks torchrun "$r/restart" "$out/torchrun-restart.log" 6 resumed
}

# gpu-run.sh torchrun-kill RUN CMD...: runs CMD (a torchrun launch writing RUN) in the
# background, kill -9s its birdtrain worker once RUN/checkpoint.json exists, and waits for CMD.
torchrun_kill() {
  local run=$1; shift
  "$@" &
  local launcher=$! i worker=""
  for i in $(seq 1200); do
    [ -f "$run/checkpoint.json" ] && break
    kill -0 "$launcher" 2>/dev/null || break
    sleep 0.1
  done
  if [ ! -f "$run/checkpoint.json" ]; then
    echo "no checkpoint in $run before the launcher ended or 120 s passed"
    kill "$launcher" 2>/dev/null; wait "$launcher"; return 3
  fi
  # The worker: the birdtrain process among the launcher's descendants.
  local pids=("$launcher") p
  while [ ${#pids[@]} -gt 0 ] && [ -z "$worker" ]; do
    local next=()
    for p in "${pids[@]}"; do
      while read -r child comm; do
        [ "$comm" = birdtrain ] && worker=$child
        next+=("$child")
      done < <(ps -o pid=,comm= --ppid "$p")
    done
    pids=("${next[@]}")
  done
  if [ -z "$worker" ]; then
    echo "no birdtrain worker under the launcher (pid $launcher)"
    wait "$launcher"; return 3
  fi
  local at
  at=$(python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); print("epoch", d["epoch"], "step", d["step"])' "$run/checkpoint.json" 2>&1)
  echo "kill -9 of worker $worker after its first checkpoint ($at)"
  kill -9 "$worker"
  wait "$launcher"
}

# Batch norm fused into the convolutions (ARCHITECTURE.md; the default since its tests passed
# on an H100 and it measured faster there, 2026-11-27; BIRDTRAIN_BN_FUSION=0 turns it off): its
# GPU tests first (they choose the fused sequence themselves, or are run here with the variable
# set), then the steps fused and separate on the GPU alone, one after the other, each with the
# variable set explicitly.
phase_fusion() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
  step kernels-check 120 "$bin" kernels check --arch sm_90
  step test-fusion-ops 120 "$test_bin" --ignored --test-threads 1 --show-output \
    cuda_kernels::fused_batch_norm
  $checks tests "$out/test-fusion-ops.log" cuda_kernels::fused_batch_norm 1 | tee -a "$summary"
  # The stem's batch norm applied inside the max pool (maxpool_bn_* kernels) against the CPU.
  step test-fusion-pool 60 "$test_bin" --ignored --test-threads 1 --show-output \
    cuda_kernels::max_pool_applying_a_batch_norm
  $checks tests "$out/test-fusion-pool.log" cuda_kernels::max_pool_applying 1 | tee -a "$summary"
  step test-fusion-step 150 "$test_bin" --ignored --test-threads 1 --show-output \
    cuda_step::resnet18_step_matches_cpu cuda_step::fused_resnet18_steps_repeat_bitwise
  $checks tests "$out/test-fusion-step.log" cuda_step::resnet18_step 1 | tee -a "$summary"
  $checks tests "$out/test-fusion-step.log" cuda_step::fused_resnet18 1 | tee -a "$summary"
  # Synchronised BN with the fused moments: two replicas through the host against the CPU on
  # the whole batch (the test sets the fusion), then the side communicator's device path with
  # every network of that test fused.
  step test-fusion-sync 120 "$test_bin" --ignored --test-threads 1 --show-output \
    cuda_sync_bn::fused_gpu_replicas_with_sync_bn
  $checks tests "$out/test-fusion-sync.log" cuda_sync_bn::fused_gpu_replicas 1 | tee -a "$summary"
  BIRDTRAIN_BN_FUSION=1 step test-fusion-sync-side 90 "$test_bin" --ignored --test-threads 1 \
    --show-output cuda_sync_bn::sync_bn_on_the_side_communicator
  $checks tests "$out/test-fusion-sync-side.log" cuda_sync_bn::sync_bn_on_the_side 1 | tee -a "$summary"
  local m
  for m in resnet50 resnet18; do
    BIRDTRAIN_BN_FUSION=1 step "bench-$m-fused" 90 "$bin" bench step --model $m --batch-size 256 \
      --json --breakdown --warmup 10 --steps 30
    BIRDTRAIN_BN_FUSION=0 step "bench-$m-separate" 90 "$bin" bench step --model $m --batch-size 256 \
      --json --breakdown --warmup 10 --steps 30
    check $checks fusion-bench "$out/bench-$m-fused.log" "$out/bench-$m-separate.log" $m
  done
  fusion_rounds
}

# CUDA graphs of the training step (BIRDTRAIN_CUDA_GRAPH=1, src/cuda/graph.rs; off by default
# until this phase has passed on a GPU and measured faster): the replayed steps against the
# eager ones to the bit (cuda_graph:: at the library's level, resnet18; train_gpu:: through the
# trainer, resnet8 with every per-step value in use), then resnet50's b256 step eager and
# replayed, one after the other (the graph-timing line: a measurement, no verdict).
phase_graphs() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
  step test-graphs 240 "$test_bin" --ignored --test-threads 1 --show-output \
    cuda_graph:: train_gpu::graph_replay_trains_to_the_same_bits_as_eager_launches
  $checks tests "$out/test-graphs.log" cuda_graph:: 2 | tee -a "$summary"
  $checks tests "$out/test-graphs.log" train_gpu::graph_replay 1 | tee -a "$summary"
  grep -h "graph-timing\|graph launches" "$out/test-graphs.log" | sed 's/^/INFO /' | tee -a "$summary"
}

# bench_pair's step for model $1 again with batch norm in its own passes
# (BIRDTRAIN_BN_FUSION=0), the same steps, right after it on the same GPU, and the
# fused-against-separate line (bench_pair's step is fused: the default).
bench_fused() {
  local m=$1 steps=${BENCH_STEPS:-50}
  if [ "${BIRDTRAIN_BN_FUSION:-1}" = 0 ]; then
    note "SKIP bn-fusion $m: BIRDTRAIN_BN_FUSION=0 for the whole run, so bench-$m ran separate already"
    return
  fi
  BIRDTRAIN_BN_FUSION=0 step "bench-$m-separate" 150 "$bin" bench step --model $m --batch-size 256 --json \
    --breakdown --warmup $(( steps < 15 ? 5 : 15 )) --steps "$steps"
  check $checks fusion-bench "$out/bench-$m.log" "$out/bench-$m-separate.log" $m
}

# resnet50's step fused and separate in three alternating rounds without --breakdown (whose
# per-kernel timing stretches the step), and the line comparing their medians.
fusion_rounds() {
  local r v fused=() separate=()
  for r in 1 2 3; do
    for v in 1 0; do
      BIRDTRAIN_BN_FUSION=$v step "bench-resnet50-bn$v-r$r" 60 "$bin" bench step --model resnet50 \
        --batch-size 256 --json --warmup 10 --steps 40
    done
    fused+=("$out/bench-resnet50-bn1-r$r.log"); separate+=("$out/bench-resnet50-bn0-r$r.log")
  done
  check $checks fusion-rounds resnet50 "$(IFS=,; echo "${fused[*]}")" "$(IFS=,; echo "${separate[*]}")"
}

# What --grad-accum-steps costs a resnet50 epoch at 224 px on the data-wait run's set: 128 × 2
# accumulated against 128 alone and against one batch of 256, two epochs each, the last
# (warm) epoch's training images/s compared.
accum_cost() {
  [ "$gpus" = 0 ] && { note "SKIP accum-cost: needs a GPU"; return; }
  local b=$work/synth-big r=$work/runs-accum c=$work/cache
  rm -rf "$r"; mkdir -p "$r"
  local common=(--data "$b" --gpus "$gpus" --model resnet50 --image-size 224 --epochs 2 --cache-dir "$c")
  step accum-two 120 "$bin" "${common[@]}" --batch-size 128 --grad-accum-steps 2 --out "$r/two"
  step accum-micro 120 "$bin" "${common[@]}" --batch-size 128 --out "$r/micro"
  step accum-whole 120 "$bin" "${common[@]}" --batch-size 256 --out "$r/whole"
  grep -E "^epoch |global batch" "$out/accum-two.log" "$out/accum-micro.log" "$out/accum-whole.log"
  check $checks accum-cost "$out/accum-two.log" "$out/accum-micro.log" "$out/accum-whole.log"
}

# Time to accuracy on Fashion-MNIST (benches/fashion_mnist/README.md): the idx files carried in
# .gpu/fashion-mnist/ become an image folder (convert.py), then birdtrain (--gpus 1) and the
# PyTorch peer (torch.compile, bf16 autocast, channels_last, a DataLoader over the PNGs) train
# resnet20 with one recipe, one after the other, each stopped at the end of its first epoch
# with test accuracy >= 0.93; they share what is left of the call ($DEADLINE), birdtrain at most
# half of it. $TTA_EPOCHS (default 12) sets the cosine schedule's length on both sides.
# GPUS=0: 200 images a class, 3 epochs of 64, target 0.5, on the CPU: a smoke test of the phase
# ($TTA_PYTHON: an interpreter with torch and torchvision, default python3; here that is
# /usr/bin/python3, Debian's python3-torch).
phase_tta() {
  # The idx files: .gpu-data/ beside .gpu/ (gpu-build.sh), or in .gpu/ itself.
  local src=$here/../.gpu-data/fashion-mnist d=$work/fmnist r=$work/tta
  [ -f "$src/train-images-idx3-ubyte.gz" ] || src=$here/fashion-mnist
  if [ ! -f "$src/train-images-idx3-ubyte.gz" ]; then
    note "FAIL tta: no idx files in $src (scripts/gpu-build.sh copies them where dataset-fashion-mnist is installed)"
    return
  fi
  local limit=() target=0.93 goal=2
  local recipe=(--epochs "${TTA_EPOCHS:-12}" --batch-size 256 --lr 0.2 --warmup-epochs 1)
  if [ "$gpus" = 0 ]; then
    d=$work/fmnist-small limit=(--limit 200) target=0.5 goal=0
    recipe=(--epochs 3 --batch-size 64 --lr 0.2 --warmup-epochs 1 --workers 2 --threads 2)
  fi
  step tta-convert 150 python3 "$here/fashion_mnist/convert.py" --src "$src" --dest "$d" "${limit[@]}" \
    || return
  # The driver stops its sides within the time left, less a margin for its own summary.
  local left=$((deadline - SECONDS - 30))
  step tta 600 "${TTA_PYTHON:-python3}" "$here/fashion_mnist/run_tta.py" --bin "$bin" --data "$d" --gpus "$gpus" \
    "${recipe[@]}" --target "$target" --stop-at-target --time-limit "$left" --out "$r"
  cp "$r"/*.log "$r/tta.json" "$out/" 2>/dev/null
  grep -vE "^  " "$out/tta.log" | tail -6
  check $checks tta "$r/tta.json" "$goal"
}

# The Python package's GPU tests (python/tests, marked gpu; scripts/gpu-build.sh carries the
# abi3 wheel, the tests and pytest's wheels): the wheels installed with `pip install --no-deps
# --target` into a fresh folder (no network here; a python3 without pip unpacks them instead:
# a wheel is a zip of what it installs), then pytest -m gpu with that folder on PYTHONPATH.
phase_python() {
  local py=$work/python-pkg whl
  whl=$(ls "$here"/birdtrain-*.whl 2>/dev/null | head -1)
  if [ -z "$whl" ] || [ ! -f "$here/python-tests/test_gpu.py" ]; then
    note "FAIL python: no birdtrain wheel or python-tests/ in $here (scripts/gpu-build.sh builds them)"
    return
  fi
  rm -rf "$py"; mkdir -p "$py"
  local wheels=("$whl")
  python3 -c "import pytest" 2>/dev/null || wheels+=("$here"/wheels/*.whl)
  if python3 -m pip --version >/dev/null 2>&1; then
    step python-install 120 python3 -m pip install --no-deps --no-index --disable-pip-version-check \
      --target "$py" "${wheels[@]}" || return
  else
    step python-install 60 bash -c 'py=$1; shift; for w; do python3 -m zipfile -e "$w" "$py" || exit; done' \
      unpack "$py" "${wheels[@]}" || return
  fi
  python3 -c "import torch, torchvision; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')" 2>&1 | tee -a "$summary"
  # COLUMNS: the short summary keeps each failure's message (gpu_checks.py pytest reads it).
  ( cd "$here/python-tests" && COLUMNS=400 PYTHONPATH="$py" \
      step python-gpu-tests 200 python3 -m pytest -m gpu -v -rfE -p no:cacheprovider . )
  tail -5 "$out/python-gpu-tests.log"
  check $checks pytest "$out/python-gpu-tests.log" 7
  # The default (CPU) suite where torch has CUDA: every loader of it page-locks its buffers
  # (pin_memory=True is the default), which the CPU machines never do.
  ( cd "$here/python-tests" && COLUMNS=400 PYTHONPATH="$py" \
      step python-cpu-tests 200 python3 -m pytest -v -rfE -p no:cacheprovider . )
  tail -3 "$out/python-cpu-tests.log"
  # One line for the passes, one per failure (and one if fewer than 60 ran).
  $checks pytest "$out/python-cpu-tests.log" 60 >"$out/python-cpu-checks.txt"
  local verdict=PASS; grep -q "^FAIL " "$out/python-cpu-checks.txt" && verdict=FAIL
  note "$verdict python-default-suite: $(grep -c "^PASS " "$out/python-cpu-checks.txt") tests passed"
  grep -v "^PASS " "$out/python-cpu-checks.txt" | tee -a "$summary"
}

# resnet50's step with the v3 and the v2 convolutions in three alternating rounds, and the line
# comparing their medians.
conv3_rounds() {
  local r v rounds_v3=() rounds_v2=()
  for r in 1 2 3; do
    for v in v3 v2; do
      BIRDTRAIN_CONV=$v step "bench-resnet50-$v-r$r" 60 "$bin" bench step --model resnet50 \
        --batch-size 256 --json --warmup 10 --steps 40
    done
    rounds_v3+=("$out/bench-resnet50-v3-r$r.log"); rounds_v2+=("$out/bench-resnet50-v2-r$r.log")
  done
  check $checks conv3-rounds resnet50 "$(IFS=,; echo "${rounds_v3[*]}")" "$(IFS=,; echo "${rounds_v2[*]}")"
}

# resnet50's default (v3) step under the three tile schedules of its 128-column GEMMs
# (BIRDTRAIN_CONV3_TILES: blocks, the default; raster; persistent), and under blocks and
# persistent with packed masks (BIRDTRAIN_BN_MASK=packed: the inner ones recomputed, the
# blocks' outputs' read from packed signs), in three alternating rounds: a line comparing each
# schedule's median with the default's, and one comparing each schedule's packed masks with
# its stored ones.
tiles_rounds() {
  local r t m setting
  local -A rounds=()
  for r in 1 2 3; do
    for setting in blocks:stored raster:stored persistent:stored blocks:packed persistent:packed; do
      t=${setting%%:*}; m=${setting##*:}
      BIRDTRAIN_CONV=v3 BIRDTRAIN_CONV3_TILES=$t BIRDTRAIN_BN_MASK=$m \
        step "bench-resnet50-tiles-$t-$m-r$r" 60 "$bin" bench step \
        --model resnet50 --batch-size 256 --json --warmup 10 --steps 40
      rounds[$setting]+="${rounds[$setting]:+,}$out/bench-resnet50-tiles-$t-$m-r$r.log"
    done
  done
  check $checks tiles-rounds resnet50 persistent "${rounds[persistent:stored]}" "${rounds[blocks:stored]}"
  check $checks tiles-rounds resnet50 raster "${rounds[raster:stored]}" "${rounds[blocks:stored]}"
  for setting in blocks:packed persistent:packed; do
    t=${setting%%:*}; m=${setting##*:}
    check $checks mask-rounds resnet50 "$t" "$m" "${rounds[$setting]}" "${rounds[$t:stored]}"
  done
}

# The persistent v3 kernels (BIRDTRAIN_CONV3_TILES) and the masks' sources
# (BIRDTRAIN_BN_MASK; < 7 min; DEADLINE=400, timeout_s 430): the resnet50 step under each
# schedule and each mask source to the bit (two GPU tests, which also check that the `_p`
# kernels ran, that y was not read and that the signs were packed) beside every v3 op test
# run on the persistent kernels; then, only if they passed, the settings in alternating
# rounds, and a breakdown of `persistent`, of `blocks` and of `blocks` with packed signs
# (compare each conv3_*_p and conv3_*_n64_p row with its original's, the conv3_dgrad_bn_*
# rows across the masks, and bn_apply_signs_vec with bn_apply_vec).
phase_tiles() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
  step test-conv3-tiles 150 "$test_bin" --ignored --test-threads 1 --nocapture \
    cuda_step::conv3_tile_schedules_give_the_same_step_bits \
    cuda_step::mask_sources_give_the_stored_masks_step_bits &
  # Every v3 op test (odd shapes, tails, the fused batch norm) on the persistent kernels.
  BIRDTRAIN_CONV3_TILES=persistent step test-conv3-ops-persistent 150 "$test_bin" --ignored \
    --test-threads 1 --nocapture cuda_kernels::conv3_ &
  wait
  check $checks tests "$out/test-conv3-tiles.log" cuda_step:: 2
  check $checks tests "$out/test-conv3-ops-persistent.log" cuda_kernels::conv3_ 2
  if grep -q "^FAIL .*conv3-tiles\|^FAIL .*cuda_step::\|^FAIL .*conv3-ops-persistent\|^FAIL .*cuda_kernels::conv3_" "$summary"; then
    note "SKIP tiles-rounds: the schedules' or the masks' bits differ, or a test did not finish (above)"
    return
  fi
  tiles_rounds
  local setting
  for setting in persistent:stored blocks:stored blocks:packed; do
    BIRDTRAIN_CONV=v3 BIRDTRAIN_CONV3_TILES=${setting%%:*} BIRDTRAIN_BN_MASK=${setting##*:} \
      step "bench-resnet50-${setting%%:*}-${setting##*:}-breakdown" 60 "$bin" \
      bench step --model resnet50 --batch-size 256 --json --breakdown --warmup 10 --steps 20
  done
}

# resnet50's (v2) step with the inner batch norms applied by the convolutions
# (BIRDTRAIN_BN_PROLOGUE=1) and stored (0) in three alternating rounds, and the line comparing
# their medians.
prologue_rounds() {
  local r v rounds_on=() rounds_off=()
  for r in 1 2 3; do
    for v in 1 0; do
      BIRDTRAIN_CONV=v2 BIRDTRAIN_BN_PROLOGUE=$v step "bench-resnet50-prologue$v-r$r" 60 "$bin" \
        bench step --model resnet50 --batch-size 256 --json --warmup 10 --steps 40
    done
    rounds_on+=("$out/bench-resnet50-prologue1-r$r.log")
    rounds_off+=("$out/bench-resnet50-prologue0-r$r.log")
  done
  check $checks prologue-rounds resnet50 "$(IFS=,; echo "${rounds_on[*]}")" \
    "$(IFS=,; echo "${rounds_off[*]}")"
}

# The inner batch norms applied by the convolutions that read them (BIRDTRAIN_BN_PROLOGUE, off
# by default until this passes and measures faster): the applied ops against the separate ones
# to the bit, the applied steps against the fused ones to the bit, then the timing rounds and a
# breakdown of each.
phase_prologue() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
  step test-prologue-ops 150 "$test_bin" --ignored --test-threads 1 --show-output \
    cuda_kernels::convolutions_applying_a_batch_norm cuda_kernels::v2_kernels_applying \
    cuda_kernels::conv3_dgrad_recomputes_the_mask
  $checks tests "$out/test-prologue-ops.log" cuda_kernels::convolutions_applying 1 | tee -a "$summary"
  $checks tests "$out/test-prologue-ops.log" cuda_kernels::v2_kernels_applying 1 | tee -a "$summary"
  $checks tests "$out/test-prologue-ops.log" cuda_kernels::conv3_dgrad_recomputes 1 | tee -a "$summary"
  step test-prologue-step 150 "$test_bin" --ignored --test-threads 1 --show-output \
    cuda_step::applied_batch_norm_steps_have_the_fused_bits
  $checks tests "$out/test-prologue-step.log" cuda_step::applied_batch_norm 1 | tee -a "$summary"
  prologue_rounds
  local v
  for v in 1 0; do
    BIRDTRAIN_CONV=v2 BIRDTRAIN_BN_PROLOGUE=$v step "bench-resnet50-prologue$v-breakdown" 90 "$bin" \
      bench step --model resnet50 --batch-size 256 --json --breakdown --warmup 10 --steps 20
  done
}

phase_hopper() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
  step kernels-check-90a 120 "$bin" kernels check --arch sm_90a
  step test-conv3-ops 120 "$test_bin" --ignored --test-threads 1 --nocapture cuda_kernels::conv3_
  $checks tests "$out/test-conv3-ops.log" cuda_kernels::conv3_ 2 | tee -a "$summary"
  step test-conv3-step 150 "$test_bin" --ignored --test-threads 1 --nocapture \
    cuda_step::resnet50_v3_step_matches_cpu
  $checks tests "$out/test-conv3-step.log" cuda_step::resnet50_v3 1 | tee -a "$summary"
  if command -v compute-sanitizer >/dev/null; then
    step sanitize-conv3 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
      "$test_bin" --ignored --test-threads 1 cuda_kernels::conv3_ops
  fi
  conv3_rounds
  BIRDTRAIN_CONV=v3 step bench-resnet50-v3-breakdown 90 "$bin" bench step --model resnet50 \
    --batch-size 256 --json --breakdown --warmup 10 --steps 20
}

# After a change of the default path (< 4 min; DEADLINE=185, timeout_s 220): every GPU test
# module but cuda_memory side by side, one PASS/FAIL line per test, and the Python package; then
# resnet50's default step against BIRDTRAIN_CONV=v2 once each (what the default runs).
phase_verify() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
  local t
  for t in "${shared_tests[@]}"; do
    step "test-$t" 150 "$test_bin" --ignored --test-threads 1 --nocapture "$t::" &
  done
  phase_python >"$out/python-checks.txt" 2>&1 &
  wait
  for t in "${shared_tests[@]}"; do
    $checks tests "$out/test-$t.log" "$t::" 1 | tee -a "$summary"
  done
  step bench-resnet50-default 60 "$bin" bench step --model resnet50 --batch-size 256 --json \
    --warmup 10 --steps 40
  BIRDTRAIN_CONV=v2 step bench-resnet50-v2 60 "$bin" bench step --model resnet50 --batch-size 256 \
    --json --warmup 10 --steps 40
  grep -h '"ms_per_step"' "$out/bench-resnet50-default.log" "$out/bench-resnet50-v2.log" \
    | python3 -c 'import json,sys; [print("INFO step", r["ms_per_step"], r["batch_norm"]) for r in map(json.loads, sys.stdin)]' \
    | tee -a "$summary"
}

# The timed work of issue 31 alone, for a call after the correctness checks (< 5 min;
# DEADLINE=300, timeout_s 330): resnet50 v3 against v2 in alternating rounds, a breakdown of
# each sequence (v2, v3, v2 with the applied batch norms), resnet18 v3 against v2, then the
# PyTorch peer eager and compiled right after birdtrain's default resnet50 step on the same
# GPU, and resnet18's default step against the eager peer.
phase_timing() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
  conv3_rounds
  local v
  for v in v2 v3; do
    BIRDTRAIN_CONV=$v step "bench-resnet50-$v-breakdown" 60 "$bin" bench step --model resnet50 \
      --batch-size 256 --json --breakdown --warmup 10 --steps 20
  done
  BIRDTRAIN_CONV=v2 BIRDTRAIN_BN_PROLOGUE=1 step bench-resnet50-prologue1-breakdown 60 "$bin" \
    bench step --model resnet50 --batch-size 256 --json --breakdown --warmup 10 --steps 20
  for v in v3 v2; do
    BIRDTRAIN_CONV=$v step "bench-resnet18-$v" 60 "$bin" bench step --model resnet18 \
      --batch-size 256 --json --warmup 10 --steps 40
  done
  BENCH_STEPS=30 bench_pair resnet50
  bench_compiled_peer
  BENCH_STEPS=30 bench_pair resnet18
}

# What has never run on a GPU, in one call (< 6 min; DEADLINE=330, timeout_s 360): first the
# correctness of all of it side by side on the one GPU (only pass/fail is read there): the
# sm_90a compile, every kernel test (cuda_kernels::, the v3 ones listing each op PASS/FAIL),
# the default path's steps and the resnet50 v3 step against the CPU, the CUDA graph replays against eager, the Python
# package; then, with the GPU alone: resnet50 v3 against v2 in alternating rounds (only when
# the v3 tests passed: a wrong kernel's time means nothing) and the graph's step timing.
phase_next() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
  step kernels-check-90a 120 "$bin" kernels check --arch sm_90a &
  # The v3 kernels in processes of their own: a hung one (an mbarrier waiting for bytes that
  # never land spins until the step's limit) then holds up no other kernel's verdict.
  step test-kernels 200 "$test_bin" --ignored --test-threads 1 --nocapture cuda_kernels:: \
    --skip cuda_kernels::conv3_ &
  step test-conv3-ops 150 "$test_bin" --ignored --test-threads 1 --nocapture cuda_kernels::conv3_ &
  step test-conv3-step 150 "$test_bin" --ignored --test-threads 1 --nocapture \
    cuda_step::resnet50_v3_step_matches_cpu &
  # The default path's whole step against the CPU (the paired stem, the pool-applied stem BN).
  step test-step 200 "$test_bin" --ignored --test-threads 1 --nocapture cuda_step:: \
    --skip cuda_step::resnet50_v3 &
  step test-graphs 200 "$test_bin" --ignored --test-threads 1 --show-output \
    cuda_graph::replayed_steps_give_the_eager_steps_bits \
    train_gpu::graph_replay_trains_to_the_same_bits_as_eager_launches &
  phase_python >"$out/python-checks.txt" 2>&1 &
  wait
  $checks tests "$out/test-kernels.log" cuda_kernels:: 10 | tee -a "$summary"
  $checks tests "$out/test-conv3-ops.log" cuda_kernels::conv3_ 2 | tee -a "$summary"
  $checks tests "$out/test-conv3-step.log" cuda_step::resnet50_v3 1 | tee -a "$summary"
  $checks tests "$out/test-step.log" cuda_step:: 2 | tee -a "$summary"
  $checks tests "$out/test-graphs.log" cuda_graph:: 1 | tee -a "$summary"
  $checks tests "$out/test-graphs.log" train_gpu::graph_replay 1 | tee -a "$summary"
  if grep -q "^FAIL .*conv3" "$summary"; then  # the tests' lines, or their steps' (a hang)
    note "SKIP conv3-rounds: a v3 kernel failed its check (the FAIL lines above name it)"
  else
    conv3_rounds
  fi
  step test-graph-timing 120 "$test_bin" --ignored --test-threads 1 --show-output \
    cuda_graph::resnet50_b256_step_time_with_and_without_the_graph
  grep -h "graph-timing\|graph launches" "$out/test-graph-timing.log" | sed 's/^/INFO /' | tee -a "$summary"
  # The applied inner batch norms (their tests ran in test-kernels and test-step above).
  if grep -q "^FAIL .*\(convolutions_applying\|v2_kernels_applying\|applied_batch_norm\)" "$summary"; then
    note "SKIP prologue-rounds: an applied batch-norm check failed (the FAIL lines above name it)"
  else
    prologue_rounds
  fi
}

# Everything in one call. The correctness work runs side by side (one GPU, many processes:
# only pass/fail is read there); cuda_memory fills the GPU's memory and the timed work must
# have the GPU alone, so they follow, most important first, until $DEADLINE.
phase_all() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
  local t
  step kernels-check 120 "$bin" kernels check --arch sm_90 &
  for t in "${shared_tests[@]}"; do
    step "test-$t" 150 "$test_bin" --ignored --test-threads 1 --nocapture "$t::" &
  done
  train_checks >"$out/train-checks.txt" 2>&1 &
  phase_python >"$out/python-checks.txt" 2>&1 &
  big_set &
  wait
  for t in "${shared_tests[@]}"; do
    grep -E "^test .* (FAILED|ok|ignored)|test result|skipped|panicked" "$out/test-$t.log" | tail -30
  done
  step test-cuda_memory 90 "$test_bin" --ignored --test-threads 1 --nocapture cuda_memory::
  BENCH_STEPS=${BENCH_STEPS:-20} bench_pair resnet50
  BENCH_STEPS=${BENCH_STEPS:-20} bench_fused resnet50
  train_data_wait
  phase_auto
  sync_bn_cost
  accum_cost
  BENCH_STEPS=${BENCH_STEPS:-20} bench_pair resnet18
  bench_scaling
  BIRDTRAIN_CONV=v1 step bench-resnet50-conv-v1 60 "$bin" bench step --model resnet50 --batch-size 256 \
    --json --warmup 3 --steps 10
  sanitize
  ncu_top "$out/bench-resnet50.log"
  bench_compiled_peer
}

if [ "$phase" = torchrun-kill ]; then trap - EXIT; shift; torchrun_kill "$@"; exit; fi
# One phase, or several separated by commas (`tiles,timing`), run in turn under the one
# $DEADLINE: one device call instead of several (each call may find the machine released and
# start a fresh one), one summary and one tarball.
IFS=, read -ra phases <<<"$phase"
[ "${#phases[@]}" -gt 0 ] || phases=("")
for p in "${phases[@]}"; do
  case "$p" in
    tests|bench|train|auto|syncbn|ncu|multi|fusion|prologue|tta|python|hopper|graphs|next|timing|tiles|verify|all) ;;
    *) echo "usage: gpu-run.sh PHASE[,PHASE…]: tests|bench|train|auto|syncbn|ncu|multi|fusion|prologue|tta|python|hopper|graphs|next|timing|tiles|verify|all (one call runs them in turn)" >&2; exit 2 ;;
  esac
done
: >"$summary"
note "== gpu-run.sh $phase on $(hostname) $(date -u +%FT%TZ) (GPUS=$gpus, BIRDTRAIN_BN_FUSION=${BIRDTRAIN_BN_FUSION:-unset: on})"
discover
shift
for p in "${phases[@]}"; do
  [ "${#phases[@]}" -eq 1 ] || note "== phase $p ($((deadline - SECONDS)) s left)"
  "phase_$p" "$@"
done
echo; echo "== summary ($summary)"; cat "$summary"
