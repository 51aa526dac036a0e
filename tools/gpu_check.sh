#!/usr/bin/env bash
# tools/gpu_check.sh: the GPU check, in one script for one CUDA machine.
#
#   tools/gpu_check.sh [--debs DIR] [--out DIR] [--steps N]
#
# 1. builds Xirang with the CUDA backend (sm_90 unless XIRANG_CUDA_ARCHS is
#    set) into build-gpu/,
# 2. runs the GPU tests: every CUDA kernel against the CPU op (cuda_tests),
#    compute-sanitizer memcheck and racecheck on the hand-written kernels'
#    tests (at most 90 s each), and the NCCL communicator in a group of one
#    (mpi_nccl_tests),
# 3. trains gpt2_debug in fp32 on the GPU and on the CPU from the same data
#    and seed and compares the losses (within 1e-4 relative at every step:
#    fp32 accumulation order is all that may differ),
# 4. trains gpt2_124m in bf16 on one GPU for a few steps, prints tokens/s
#    and MFU (metrics JSONL in OUT) and checks that the loss fell.
# 5. trains 4 steps with a trace and the per-op profile and checks their CUDA
#    paths (device-stream spans, op times from stream events, parts >= 0).
# Budget: under 8 minutes on an H200 (the build is most of it).
#
# A machine without the Debian packages tools/setup.sh installs (and no way
# to fetch them) gets them from --debs DIR: .deb files that
# tools/fetch_gpu_debs.sh downloads on a machine that can. They are unpacked
# into a private prefix, never over the system.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
debs="" out="$root/runs/gpu_check" steps=12
while [[ $# -gt 0 ]]; do
  case "$1" in
    --debs) debs="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    *) echo "gpu_check: unknown argument '$1' (expected --debs DIR, --out DIR, --steps N)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
log() { echo "[gpu_check $(date +%H:%M:%S)] $*"; }
t0=$(date +%s)

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

# Dependencies from carried .deb files, unpacked into a prefix of their own.
if [[ -n "$debs" ]]; then
  prefix=/tmp/xirang-deps
  mkdir -p "$prefix"
  for f in "$debs"/*.deb; do dpkg-deb -x "$f" "$prefix"; done
  multi=$prefix/usr/lib/x86_64-linux-gnu
  export CMAKE_PREFIX_PATH="$prefix/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export CPATH="$prefix/usr/include:$prefix/usr/include/hdf5/serial${CPATH:+:$CPATH}"
  export LIBRARY_PATH="$multi:$multi/hdf5/serial${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export LD_LIBRARY_PATH="$multi:$multi/openblas-pthread:$multi/hdf5/serial${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PKG_CONFIG_PATH="$multi/pkgconfig:$prefix/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  export PATH="$prefix/usr/bin:$PATH"
  export OPAL_PREFIX="$prefix/usr"  # a relocated Open MPI finds its own files
  log "unpacked $(ls "$debs"/*.deb | wc -l) packages into $prefix"
fi

# NCCL: the toolkit's, or the one the image's Python packages carry.
if [[ -z "${NCCL_ROOT:-}" ]] && ! ls /usr/local/cuda/lib64/libnccl.so* >/dev/null 2>&1; then
  nccl_py=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null || true)
  if [[ -n "$nccl_py" ]]; then
    export NCCL_ROOT="$nccl_py"
    [[ -e "$nccl_py/lib/libnccl.so" ]] || ln -sf "$(ls "$nccl_py"/lib/libnccl.so.* | head -1)" "$nccl_py/lib/libnccl.so" || true
    export LD_LIBRARY_PATH="$nccl_py/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
fi

log "configure and build (CUDA archs ${XIRANG_CUDA_ARCHS:-90})"
export PATH="/usr/local/cuda/bin:$PATH"
cmake -S "$root" -B "$root/build-gpu" -G Ninja -DCMAKE_BUILD_TYPE=Release -DXIRANG_CUDA=ON \
  -DXIRANG_CUDA_ARCHS="${XIRANG_CUDA_ARCHS:-90}" ${NCCL_ROOT:+-DNCCL_ROOT=$NCCL_ROOT} >"$out/configure.log" 2>&1 ||
  { tail -30 "$out/configure.log"; exit 1; }
cmake --build "$root/build-gpu" --target xirang cuda_tests mpi_nccl_tests -j "$(nproc)" >"$out/build.log" 2>&1 ||
  { grep -E "error|Error" "$out/build.log" | head -30; exit 1; }
log "built in $(( $(date +%s) - t0 )) s"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
status=0
log "GPU kernel tests (each CUDA op against the CPU op)"
"$root/build-gpu/bin/cuda_tests" --gtest_brief=1 2>&1 | tee "$out/cuda_tests.log" | tail -25 || status=1
# Out-of-bounds and shared-memory races in the hand-written kernels (attention,
# cross entropy, LayerNorm, embedding): memcheck and racecheck on their tests,
# each bounded so that a slow sanitizer cannot eat the budget.
if command -v compute-sanitizer >/dev/null || [[ -x /usr/local/cuda/bin/compute-sanitizer ]]; then
  for tool in memcheck racecheck; do
    log "compute-sanitizer $tool on the attention, cross-entropy, LayerNorm and embedding tests"
    timeout 90 compute-sanitizer --tool "$tool" --error-exitcode 3 "$root/build-gpu/bin/cuda_tests" --gtest_brief=1 \
      --gtest_filter='*Attention*:*CrossEntropy*:*LayerNorm*:*Embedding*' >"$out/sanitizer_$tool.log" 2>&1 &&
      log "$tool: clean" || { log "$tool: exit $? (see $out/sanitizer_$tool.log)"; tail -15 "$out/sanitizer_$tool.log"; status=1; }
  done
fi
log "NCCL communicator, one rank"
mpirun --oversubscribe -np 1 "$root/build-gpu/bin/mpi_nccl_tests" --gtest_brief=1 2>&1 | tee "$out/nccl_tests.log" | tail -15 || status=1

# Throughput: gpt2_124m (real shapes) in bf16 on one GPU, on byte tokens of
# this repository's text (the tokenizer does not change the work per token).
data="$out/data"
if [[ ! -e "$data/train/index.json" ]]; then
  find "$root" -path "$root/build*" -prune -o \( -name '*.md' -o -name '*.cc' -o -name '*.h' -o -name '*.cu' \) -print |
    sort | head -400 >"$out/text_files"
  "$root/build-gpu/bin/xirang" data prepare --tokenizer bytes --force --val-fraction 0.05 --out "$data" \
    $(cat "$out/text_files") >"$out/prepare.log" 2>&1 || { tail "$out/prepare.log"; exit 1; }
fi
# The GPU against the CPU: gpt2_debug in fp32, same data, seed and batch.
: >"$out/summary.txt"
log "gpt2_debug fp32, 10 steps on the GPU and on the CPU"
for backend in cuda cpu; do
  "$root/build-gpu/bin/xirang" train "$root/configs/gpt2_debug.yaml" \
    --set device.backend=$backend --set precision.dtype=fp32 --set train.steps=10 --set train.eval_every=0 \
    --set data.train="$data/train" --set data.val= --set checkpoint.dir= \
    --set metrics.jsonl="$out/debug_$backend.jsonl" --set metrics.log_every=1 >"$out/debug_$backend.log" 2>&1 ||
    { tail -5 "$out/debug_$backend.log"; status=1; }
done
python3 - "$out/debug_cuda.jsonl" "$out/debug_cpu.jsonl" <<'EOF' | tee -a "$out/summary.txt" || status=1
import json, sys
def losses(path):
    try:
        return [json.loads(l)["loss"] for l in open(path) if l.strip()]
    except OSError:
        return []
gpu, cpu = losses(sys.argv[1]), losses(sys.argv[2])
bad = []
if len(gpu) != 10 or len(cpu) != 10:
    bad.append(f"expected 10 steps from each backend, got {len(gpu)} on the GPU and {len(cpu)} on the CPU")
for step, (g, c) in enumerate(zip(gpu, cpu), 1):
    rel = abs(g - c) / abs(c)
    print(f"gpt2_debug fp32 step {step}: GPU {g:.6f} CPU {c:.6f} rel diff {rel:.1e}")
    if not rel <= 1e-4:
        bad.append(f"step {step}: GPU loss {g} differs from the CPU's {c} by {rel:.1e} (limit 1e-4)")
for b in bad:
    print("FAIL:", b)
sys.exit(1 if bad else 0)
EOF

log "gpt2_124m bf16 training, $steps steps"
"$root/build-gpu/bin/xirang" train "$root/configs/gpt2_124m.yaml" \
  --set device.backend=cuda --set precision.dtype=bf16 --set train.steps="$steps" --set train.warmup_steps=2 \
  --set train.global_batch=16 --set train.micro_batch=16 --set train.eval_every=0 \
  --set data.train="$data/train" --set data.val= --set checkpoint.dir= \
  --set metrics.jsonl="$out/metrics.jsonl" --set metrics.log_every=1 2>&1 | tee "$out/train.log" | tail -20 || status=1
if [[ -s "$out/metrics.jsonl" ]]; then
  python3 - "$out/metrics.jsonl" <<'EOF' | tee -a "$out/summary.txt" || status=1
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
warm = rows[2:] if len(rows) > 4 else rows  # the first steps include cuBLASLt heuristics and first-touch costs
tok = sum(r["tokens_per_s"] for r in warm) / len(warm)
mfu = sum(r["mfu"] for r in warm) / len(warm)
print(f"gpt2_124m bf16, 1 GPU, {len(rows)} steps: {tok:,.0f} tokens/s, MFU {100*mfu:.1f}% "
      f"of {rows[-1]['peak_tflops']:.0f} TFLOP/s ({rows[-1]['peak_source']}); "
      f"loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}")
# Learning, not only running: the loss falls over the run.
if not rows[-1]["loss"] < rows[0]["loss"] - 0.1:
    print(f"FAIL: gpt2_124m loss did not fall: {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f} in {len(rows)} steps")
    sys.exit(1)
EOF
else
  log "FAIL: gpt2_124m training wrote no metrics"
  status=1
fi
# The metrics' CUDA paths: the device-stream spans of a trace, the per-op
# profile from stream events, and the step's parts (device-timed forward,
# backward, tp and dp waits), checked for sanity and printed.
log "trace and per-op profile on the GPU, 4 steps"
"$root/build-gpu/bin/xirang" train "$root/configs/gpt2_124m.yaml" \
  --set device.backend=cuda --set precision.dtype=bf16 --set train.steps=4 --set train.warmup_steps=2 \
  --set train.global_batch=16 --set train.micro_batch=8 --set train.eval_every=0 \
  --set data.train="$data/train" --set data.val= --set checkpoint.dir= --set metrics.op_profile=true \
  --set metrics.trace="$out/trace" --set metrics.trace_steps=2-3 \
  --set metrics.jsonl="$out/observe.jsonl" >"$out/observe.log" 2>&1 || { tail "$out/observe.log"; status=1; }
"$root/build-gpu/bin/xirang" trace merge "$out/trace" >>"$out/observe.log" 2>&1 || { tail -3 "$out/observe.log"; status=1; }
if [[ -s "$out/observe.jsonl" && -s "$out/trace/trace.json" ]]; then
  python3 - "$out/observe.jsonl" "$out/trace/trace.json" <<'EOF' | tee -a "$out/summary.txt" || status=1
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
trace = json.load(open(sys.argv[2]))
parts = ["forward_ms", "backward_ms", "optimizer_ms", "data_wait_ms", "dp_comm_exposed_ms", "tp_comm_ms",
         "pp_bubble_ms", "pp_comm_exposed_ms", "ckpt_stall_ms"]
bad = []
for r in rows[1:]:
    bad += [f"step {r['step']}: {p} {r[p]:.3f} < 0" for p in parts if r[p] < 0]
    ops = r.get("op_ms", {})
    if not ops.get("matmul", 0) > 0: bad.append(f"step {r['step']}: no matmul time in op_ms {ops}")
    print(f"step {r['step']}: step {r['step_ms']:.1f} ms, parts " + ", ".join(f"{p[:-3]} {r[p]:.1f}" for p in parts)
          + "; ops " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])))
device = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "device stream"]
if not device: bad.append("the trace has no device-stream spans")
if any(e["dur"] < 0 for e in trace["traceEvents"] if e.get("ph") == "X"): bad.append("a span has a negative duration")
print(f"trace: {len(device)} device-stream spans")
for b in bad: print("FAIL:", b)
sys.exit(1 if bad else 0)
EOF
fi
log "done in $(( $(date +%s) - t0 )) s, status $status"
exit $status
