#!/usr/bin/env bash
# tools/gpu_check.sh: the GPU check, one call on a lent CUDA machine.
#
#   tools/gpu_bundle.sh                                  # here: build and pack (build-gpu/bundle/)
#   tools/gpu_check.sh --bundle build-gpu/bundle/xirang-gpu.tar.xz [--out DIR] [--archive FILE]
#                      [--budget SECONDS] [--only a,b,...] [--skip a,b,...] [--tests GTEST_FILTER] [--dry-run]
#
# Nothing is compiled on the device: the binaries and the libraries the image
# lacks come in the bundle. The script first prints what it found (GPU,
# driver, where each CUDA library was taken from), then runs the checks in
# order of value, each under its own time cap and all under --budget (default
# 420 s; a check that would not fit in what is left is reported "not run"):
#
#   kernels    cuda_tests: every CUDA kernel against the CPU op in float64
#   parity     gpt2_debug, llama_debug and qwen3_debug, 20 steps in fp32 and bf16 on the GPU
#              and on the CPU from the same data and seed; fp32 losses within
#              1e-4 relative at every step, bf16 within 2e-2
#   nccl_paths gpt2_debug with NCCL groups of one (comm.nccl_alone), with and
#              without ZeRO-1, against the plain one-rank GPU run (1e-6)
#   speed      gpt2_124m bf16, B16 x T1024: tokens/s, MFU, step split
#   observe    4 steps with a trace and the per-op profile: device-stream spans
#   attention  the flash attention alone (tensor-core and fp32 paths) against
#              PyTorch's causal SDPA on gpt2_124m's shape
#   peer       the same model in PyTorch on the same GPU (torch.compile, flash
#              SDPA, fused AdamW) and the measured bf16 matrix-product rate
#   nccl       the NCCL communicator in a group of one (mpi_nccl_tests)
#   memcheck, racecheck   compute-sanitizer on the hand-written kernels'
#              tests; last, and a failure only when the tool reports an error
#              (anything else, a timeout or "device not supported", is
#              "inconclusive")
#
# Every log, metrics file and the summary are packed into one archive (by
# default $OUT/gpu_check.tar.gz when OUT is set, else OUT_DIR.tar.gz), also
# when the script stops early. The exit status is 0 when nothing failed.
#
# --dry-run replaces each GPU step by its CPU equivalent (the CUDA tests run
# and skip, the trainings run on the CPU, the PyTorch peer is skipped) so the
# plumbing (unpacking, library lookup, archive, summary, exit codes) is proven
# on a machine without a GPU: tests/cli/gpu_check_test.sh.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bundle="" out="" archive="" budget=420 only="" skip="" dry=0 tests="*"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --bundle) bundle="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --archive) archive="$2"; shift 2 ;;
    --budget) budget="$2"; shift 2 ;;
    --only) only=",$2,"; shift 2 ;;
    --skip) skip=",$2,"; shift 2 ;;
    --tests) tests="$2"; shift 2 ;;  # cuda_tests' --gtest_filter in the kernels step
    --dry-run) dry=1; shift ;;
    *) echo "gpu_check: unknown argument '$1' (expected --bundle FILE, --out DIR, --archive FILE, --budget S," \
            "--only LIST, --skip LIST, --tests FILTER, --dry-run)" >&2; exit 2 ;;
  esac
done
[[ -n $bundle ]] || { echo "gpu_check: --bundle FILE is required (tools/gpu_bundle.sh makes it)" >&2; exit 2; }
[[ -f $bundle ]] || { echo "gpu_check: bundle '$bundle' does not exist (tools/gpu_bundle.sh makes it)" >&2; exit 2; }
out="${out:-${TMPDIR:-/tmp}/xirang-gpu-check}"
if [[ -z $archive ]]; then
  if [[ -n ${OUT:-} ]]; then archive="$OUT/gpu_check.tar.gz"; else archive="$out.tar.gz"; fi
fi
rm -rf "$out" && mkdir -p "$out" "$(dirname "$archive")"
t0=$(date +%s)
log() { echo "[gpu_check +$(( $(date +%s) - t0 ))s] $*"; }
summary="$out/summary.txt"
: >"$summary"
results=()
failed=0

# The archive is written whatever happens, the summary copied beside it.
pack() {
  {
    echo "== results"
    printf '%s\n' "${results[@]}"
  } >>"$summary"
  tar -C "$(dirname "$out")" -czf "$archive" "$(basename "$out")" 2>/dev/null
  [[ -n ${OUT:-} ]] && cp "$summary" "$OUT/summary.txt" 2>/dev/null
  echo "== gpu_check: $(( $(date +%s) - t0 )) s; archive $archive ($(du -h "$archive" 2>/dev/null | cut -f1))"
  printf '%s\n' "${results[@]}"
}
trap 'pack; rm -rf "${stage:-}"' EXIT

# ------------------------------------------------------------------ inventory
{
  echo "== machine"
  echo "date $(date -u +%Y-%m-%dT%H:%M:%SZ), host $(uname -n), kernel $(uname -r), $(nproc) CPUs"
  grep -m1 'model name' /proc/cpuinfo 2>/dev/null
  [[ -f /etc/os-release ]] && (. /etc/os-release && echo "os $PRETTY_NAME")
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv,noheader 2>&1
  else
    echo "nvidia-smi: not found"
  fi
} 2>&1 | tee -a "$summary"

# The bundle, unpacked into a private prefix; only Xirang's processes see its
# libraries (through xr below), never the image's python3 or tools.
stage=$(mktemp -d "${TMPDIR:-/tmp}/xirang-gpu-bundle.XXXXXX")
if ! tar -C "$stage" -xJf "$bundle"; then
  echo "gpu_check: cannot unpack $bundle" | tee -a "$summary"; results+=("FAIL unpack"); exit 1
fi
B="$stage/xirang-gpu"
sed -n '1,2p' "$B/MANIFEST" | sed 's/^/bundle /' | tee -a "$summary"
multi="$B/usr/lib/x86_64-linux-gnu"
bundle_ld="$multi:$multi/openblas-openmp:$multi/hdf5/serial:$multi/openmpi/lib"

# Where the CUDA libraries come from: the loader's cache, the toolkit, then
# the nvidia-* Python wheels (namespace packages: no __file__, so their
# __path__ is read), then anything under /usr/local and /opt.
cuda_dirs=()
add_dir() { local d; for d in "$@"; do [[ -d $d ]] && cuda_dirs+=("$d"); done; }
add_dir /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib
while IFS= read -r d; do add_dir "$d"; done < <(python3 - 2>/dev/null <<'EOF'
import os
try:
    import nvidia
    for base in nvidia.__path__:
        for dirpath, dirnames, filenames in os.walk(base):
            if any(f.startswith("lib") and ".so" in f for f in filenames):
                print(dirpath)
except Exception:
    pass
EOF
)
find_lib() {  # soname -> the first file found
  local name="$1" d hit
  hit=$(ldconfig -p 2>/dev/null | awk -v n="$name" '$1 == n {print $NF; exit}')
  [[ -n $hit ]] && { echo "$hit"; return; }
  for d in "${cuda_dirs[@]}"; do [[ -e $d/$name ]] && { echo "$d/$name"; return; }; done
  find /usr/local /opt /usr/lib -name "$name" 2>/dev/null | head -1
}
{
  echo "== libraries"
  for name in libcuda.so.1 libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2 libcudnn.so.9 libnvidia-ml.so.1; do
    f=$(find_lib "$name")
    if [[ -n $f ]]; then
      echo "$name: $f"

    else
      echo "$name: not found"
    fi
  done
} 2>&1 | tee -a "$summary"
ld_extra=$(grep -E '^lib[^:]+: /' "$summary" | sed 's/^[^:]*: //' | xargs -r -n1 dirname | awk '!seen[$0]++' | paste -sd:)
export XR_LD="$bundle_ld${ld_extra:+:$ld_extra}"
# xr: runs a bundled program with the bundle's libraries and Open MPI
# relocated (a script, so that timeout can run it).
cat >"$stage/xr" <<EOF
#!/usr/bin/env bash
export LD_LIBRARY_PATH="$XR_LD" OPAL_PREFIX="$B/usr" PMIX_INSTALL_PREFIX="$B/usr/lib/x86_64-linux-gnu/pmix2"
export PATH="$B/usr/bin:\$PATH" OMPI_MCA_ess_singleton_isolated=1 OMPI_MCA_plm=isolated OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec "\$@"
EOF
chmod +x "$stage/xr"
xr() { "$stage/xr" "$@"; }
missing=0
for b in "$B"/bin/*; do
  while read -r line; do
    echo "ldd $(basename "$b"): $line" | tee -a "$summary"; missing=1
  done < <(LD_LIBRARY_PATH="$XR_LD" ldd "$b" | grep "not found")
done
if [[ $missing == 1 ]]; then
  results+=("FAIL libraries: a bundled binary needs a library found neither in the bundle nor on this machine")
  exit 1
fi
results+=("PASS libraries ($(( $(date +%s) - t0 )) s)")
X="$B/bin/xirang"

# ---------------------------------------------------------------- the checks
# step NAME CAP_SECONDS: decides whether NAME runs now (selected, fits the budget).
want() {
  local name="$1" cap="$2" left=$(( budget - ($(date +%s) - t0) ))
  [[ -n $only && $only != *",$name,"* ]] && return 1
  [[ -n $skip && $skip == *",$name,"* ]] && { results+=("SKIP $name (--skip)"); return 1; }
  if (( left < cap )); then
    results+=("NOT RUN $name: needs up to $cap s, $left s of the budget left"); return 1
  fi
  log "$name (cap $cap s)"
  return 0
}
# record NAME STATUS [DETAIL]
record() {
  results+=("$2 $1${3:+: $3}")
  [[ $2 == FAIL ]] && failed=1
  return 0
}
# capped CAP LOG cmd...: runs cmd under a time limit, its output in LOG.
capped() {
  local cap="$1" logf="$2"; shift 2
  [[ $1 == xr ]] && { shift; set -- "$stage/xr" "$@"; }
  timeout --kill-after=5 "$cap" "$@" >"$logf" 2>&1
}
gpu=cuda parity_steps=20 small=()
if [[ $dry == 1 ]]; then
  # The CPU stands in for the GPU: the same steps on shapes a CPU runs in seconds.
  gpu=cpu parity_steps=4
  small=(--set model.n_layer=1 --set model.seq_len=64 --set model.d_model=64 --set model.n_head=2
         --set model.vocab_size=256)
fi

if want kernels 150; then
  s=$(date +%s)
  capped 150 "$out/cuda_tests.log" xr "$B/bin/cuda_tests" --gtest_brief=1 --gtest_output="xml:$out/cuda_tests.xml" \
    --gtest_filter="$tests"
  rc=$?
  tail -30 "$out/cuda_tests.log"
  line=$(grep -E '^\[  (PASSED|FAILED)' "$out/cuda_tests.log" | paste -sd' ')
  skipped=$(grep -cE '^\[  SKIPPED \]' "$out/cuda_tests.log")
  if [[ $rc == 0 ]]; then record kernels PASS "$line ($(( $(date +%s) - s )) s)"
  else record kernels FAIL "exit $rc; $line; see cuda_tests.log"; fi
  [[ $dry == 0 && $skipped -gt 0 ]] && record kernels FAIL "$skipped tests skipped on a GPU machine"
fi

# Data: byte tokens of this repository's text (the tokenizer does not change
# the work per token).
data="$out/data"
prepare_data() {
  [[ -e $data/train/index.json ]] && return 0
  find "$root" \( -path "$root/build*" -o -path "$root/.git" -o -path "$root/third_party" \) -prune -o \
    \( -name '*.md' -o -name '*.cc' -o -name '*.h' -o -name '*.cu' \) -print | sort | head -400 >"$out/text_files"
  xr "$X" data prepare --tokenizer bytes --force --val-fraction 0.05 --out "$data" $(cat "$out/text_files") \
    >"$out/prepare.log" 2>&1
}

# A training run: train NAME CONFIG BACKEND DTYPE STEPS [--set ...]
train() {
  local name="$1" config="$2" backend="$3" dtype="$4" steps="$5"; shift 5
  capped "${train_cap:-120}" "$out/$name.log" xr "$X" train "$root/configs/$config" \
    --set device.backend="$backend" --set precision.dtype="$dtype" --set train.steps="$steps" \
    --set train.eval_every=0 --set data.train="$data/train" --set data.val= --set checkpoint.dir= \
    --set metrics.jsonl="$out/$name.jsonl" --set metrics.log_every=1 "$@"
}

if want parity 200; then
  if ! prepare_data; then
    record parity FAIL "data prepare failed: $(tail -1 "$out/prepare.log")"
  else
    for model in gpt2_debug llama_debug qwen3_debug; do
      for dtype in fp32 bf16; do
        train_cap=40 train "${model}_${dtype}_gpu" "$model.yaml" "$gpu" "$dtype" "$parity_steps" ||
          tail -5 "$out/${model}_${dtype}_gpu.log"
        train_cap=40 train "${model}_${dtype}_cpu" "$model.yaml" cpu "$dtype" "$parity_steps" ||
          tail -5 "$out/${model}_${dtype}_cpu.log"
      done
    done
    python3 - "$out" "$parity_steps" >"$out/parity.txt" 2>&1 <<'EOF'
import json, os, sys
out, n = sys.argv[1], int(sys.argv[2])
def losses(name):
    try:
        return [json.loads(l)["loss"] for l in open(os.path.join(out, name + ".jsonl")) if l.strip()]
    except OSError:
        return []
bad = 0
for model in ("gpt2_debug", "llama_debug", "qwen3_debug"):
    for dtype, tol in (("fp32", 1e-4), ("bf16", 2e-2)):
        g, c = losses(f"{model}_{dtype}_gpu"), losses(f"{model}_{dtype}_cpu")
        if len(g) != n or len(c) != n:
            print(f"FAIL {model} {dtype}: expected {n} steps from each side, got {len(g)} GPU and {len(c)} CPU")
            bad = 1
            continue
        rel = [abs(a - b) / abs(b) for a, b in zip(g, c)]
        worst = max(range(n), key=lambda i: rel[i])
        ok = all(r <= tol for r in rel)
        bad |= not ok
        print(f"{'PASS' if ok else 'FAIL'} {model} {dtype}: max rel diff {rel[worst]:.1e} at step {worst + 1} "
              f"(limit {tol:.0e}); loss {c[0]:.4f} -> {c[-1]:.4f} CPU, {g[0]:.4f} -> {g[-1]:.4f} GPU")
        for i in range(n):
            print(f"  step {i + 1:2d}: GPU {g[i]:.6f} CPU {c[i]:.6f} rel {rel[i]:.1e}")
sys.exit(bad)
EOF
    rc=$?
    grep -E '^(PASS|FAIL)' "$out/parity.txt" | tee -a "$summary"
    if [[ $rc == 0 ]]; then record parity PASS "GPU and CPU losses agree (fp32 1e-4, bf16 2e-2)"
    else record parity FAIL "see parity.txt"; fi
  fi
fi

# The device communication paths on one GPU: NCCL groups of one rank
# (comm.nccl_alone), buckets on the dp stream and their joins, with and
# without ZeRO-1, against the plain one-rank GPU run of the parity step.
if want nccl_paths 90; then
  if [[ $dry == 1 ]]; then
    record nccl_paths SKIP "dry run: comm.nccl_alone needs a GPU"
  else
    prepare_data
    train_cap=40 train nccl_alone gpt2_debug.yaml "$gpu" fp32 "$parity_steps" --set comm.nccl_alone=true
    train_cap=40 train nccl_alone_zero gpt2_debug.yaml "$gpu" fp32 "$parity_steps" --set comm.nccl_alone=true \
      --set parallel.zero=1
    python3 - "$out" "$parity_steps" >"$out/nccl_paths.txt" 2>&1 <<'EOF'
import json, os, sys
out, n = sys.argv[1], int(sys.argv[2])
def losses(name):
    try:
        return [json.loads(l)["loss"] for l in open(os.path.join(out, name + ".jsonl")) if l.strip()]
    except OSError:
        return []
ref, bad = losses("gpt2_debug_fp32_gpu"), 0
for name in ("nccl_alone", "nccl_alone_zero"):
    got = losses(name)
    if len(got) != n or len(ref) != n:
        print(f"FAIL {name}: {len(got)} steps, the plain GPU run {len(ref)}, expected {n}"); bad = 1; continue
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    ok = worst <= 1e-6
    bad |= not ok
    print(f"{'PASS' if ok else 'FAIL'} {name}: max rel diff {worst:.1e} from the one-rank GPU run (limit 1e-6)")
sys.exit(bad)
EOF
    rc=$?
    cat "$out/nccl_paths.txt" | tee -a "$summary"
    if [[ $rc == 0 ]]; then record nccl_paths PASS; else record nccl_paths FAIL "see nccl_paths.txt, nccl_alone*.log"; fi
  fi
fi

if want speed 150; then
  prepare_data
  s=$(date +%s)
  train speed_gpt2_124m gpt2_124m.yaml "$gpu" bf16 12 --set train.warmup_steps=2 \
    --set train.global_batch=16 --set train.micro_batch=16 "${small[@]}"
  rc=$?
  grep -E '^(cpu gemm|attention|memory|cuda)' "$out/speed_gpt2_124m.log" | head -8
  python3 - "$out/speed_gpt2_124m.jsonl" >"$out/speed.txt" 2>&1 <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
warm = rows[2:] if len(rows) > 4 else rows  # the first steps pay cuBLASLt heuristics and first touches
med = lambda k: statistics.median(r.get(k, 0.0) for r in warm)
parts = ["forward_ms", "backward_ms", "optimizer_ms", "data_wait_ms", "dp_comm_exposed_ms", "tp_comm_ms",
         "pp_bubble_ms", "pp_comm_exposed_ms", "ckpt_stall_ms"]
print(f"gpt2_124m bf16 B16 T{rows[0].get('seq_len', 1024)}: {med('tokens_per_s'):,.0f} tokens/s, step {med('step_ms'):.1f} ms, "
      f"MFU {100 * med('mfu'):.1f}% of {rows[-1]['peak_tflops']:.0f} TFLOP/s ({rows[-1]['peak_source']}); "
      f"loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f} in {len(rows)} steps")
print("split (median ms): " + ", ".join(f"{p[:-3]} {med(p):.2f}" for p in parts))
for k in ("joules_per_token", "avg_watts"):
    if k in rows[-1]:
        print(f"{k}: {med(k):.4g}")
if not rows[-1]["loss"] < rows[0]["loss"] - 0.1:
    print("FAIL: the loss did not fall"); sys.exit(1)
# A GPU's measured bf16 rate is a few hundred TFLOP/s (the H200: ~780).
if rows[-1]["peak_source"].startswith("measured bf16") and not 100 < rows[-1]["peak_tflops"] < 1200:
    print(f"FAIL: measured peak {rows[-1]['peak_tflops']:.0f} TFLOP/s is implausible"); sys.exit(1)
EOF
  rc2=$?
  cat "$out/speed.txt" | tee -a "$summary"
  if [[ $rc == 0 && $rc2 == 0 ]]; then record speed PASS "$(( $(date +%s) - s )) s"
  else record speed FAIL "train exit $rc; see speed_gpt2_124m.log, speed.txt"; fi
fi

if want nccl 60; then
  capped 60 "$out/nccl_tests.log" xr "$B/bin/mpi_nccl_tests" --gtest_brief=1
  rc=$?
  tail -8 "$out/nccl_tests.log"
  line=$(grep -E '^\[  (PASSED|FAILED)' "$out/nccl_tests.log" | paste -sd' ')
  if [[ $rc == 0 ]]; then record nccl PASS "$line"; else record nccl FAIL "exit $rc; $line"; fi
fi

if want observe 90; then
  prepare_data
  train observe gpt2_124m.yaml "$gpu" bf16 4 --set train.warmup_steps=2 --set train.global_batch=16 \
    --set train.micro_batch=8 --set metrics.op_profile=true --set metrics.trace="$out/trace" \
    --set metrics.trace_steps=2-3 "${small[@]}"
  rc=$?
  xr "$X" trace merge "$out/trace" >>"$out/observe.log" 2>&1 || rc=1
  python3 - "$out/observe.jsonl" "$out/trace/trace.json" "$gpu" >"$out/observe.txt" 2>&1 <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
trace = json.load(open(sys.argv[2]))
parts = ["forward_ms", "backward_ms", "optimizer_ms", "data_wait_ms", "dp_comm_exposed_ms", "tp_comm_ms",
         "pp_bubble_ms", "pp_comm_exposed_ms", "ckpt_stall_ms"]
bad = []
for r in rows[1:]:
    bad += [f"step {r['step']}: {p} {r[p]:.3f} < 0" for p in parts if r[p] < 0]
    ops = r.get("op_ms", {})
    if not ops.get("matmul", 0) > 0: bad.append(f"step {r['step']}: no matmul time in op_ms {ops}")
    print(f"step {r['step']}: {r['step_ms']:.1f} ms; " + ", ".join(f"{p[:-3]} {r[p]:.1f}" for p in parts)
          + "; ops " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])))
spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
device = [e for e in spans if e.get("cat") == "device stream"]
if sys.argv[3] == "cuda" and not device: bad.append("the trace has no device-stream spans")
if any(e["dur"] < 0 for e in spans): bad.append("a span has a negative duration")
print(f"trace: {len(spans)} spans, {len(device)} on device streams")
for b in bad: print("FAIL:", b)
sys.exit(1 if bad else 0)
EOF
  rc2=$?
  tail -4 "$out/observe.txt" | tee -a "$summary"
  if [[ $rc == 0 && $rc2 == 0 ]]; then record observe PASS; else record observe FAIL "see observe.log, observe.txt"; fi
fi

# The attention alone on gpt2_124m's shape: Xirang's paths against
# PyTorch's causal SDPA on the same GPU.
if want attention 60; then
  if [[ $dry == 1 ]]; then
    record attention SKIP "dry run: no GPU"
  else
    capped 40 "$out/attention.log" xr "$B/bin/attention_cuda_bench" --B 16 --T 1024 --H 12 --D 64 --reps 20
    rc=$?
    capped 40 "$out/attention_peer.log" env PYTHONUNBUFFERED=1 python3 "$root/bench/torch_gpt2_cuda.py" \
      --attention-only --batch 16 --seq 1024 --n-head 12 --d-model 768
    rc2=$?
    { cat "$out/attention.log"; grep '^{' "$out/attention_peer.log"; } | tee -a "$summary"
    if [[ $rc == 0 && $rc2 == 0 ]]; then record attention PASS; else record attention FAIL "exit $rc/$rc2"; fi
  fi
fi

if want peer 150; then
  if [[ $dry == 1 ]]; then
    record peer SKIP "dry run: no GPU"
  else
    capped 150 "$out/peer.log" env PYTHONUNBUFFERED=1 python3 "$root/bench/torch_gpt2_cuda.py" --batch 16 --seq 1024 --steps 20
    rc=$?
    grep '^{' "$out/peer.log" | tail -1 | tee "$out/peer.json" | tee -a "$summary"
    if [[ $rc == 0 ]]; then record peer PASS; else record peer FAIL "exit $rc; see peer.log"; tail -5 "$out/peer.log"; fi
  fi
fi

# Sanitizers last. "ERROR SUMMARY: 0 errors" is clean; errors reported by the
# tool are a failure; anything else (no such tool, a device it does not
# support, a timeout) says nothing about Xirang's code: inconclusive.
for tool in memcheck racecheck; do
  want "$tool" 75 || continue
  san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  if [[ $dry == 1 || -z $san ]]; then
    record "$tool" INCONCLUSIVE "${san:+dry run}${san:-compute-sanitizer not found}"; continue
  fi
  # racecheck is the slower tool: it takes the hand-written kernels that use
  # shared memory on their small cases (about 25 s a dtype on an H200).
  if [[ $tool == memcheck ]]; then
    filter='*Attention*:*CrossEntropy*:*LayerNorm*:*Embedding*:*Adam*:*SumSquares*:*QkNorm*:-*AttentionTc*.ForwardAndBackward*:*LongSequence*:*GptVocabulary*'
  else
    filter='*AttentionTc*ShortSequences*:*AdamW*Group*:*SumSquaresGroup*:*CrossEntropy*Fused*:*LayerNorm*:*Decode*:*QkNorm*'
  fi
  capped 75 "$out/sanitizer_$tool.log" xr "$san" --tool "$tool" --error-exitcode 3 "$B/bin/cuda_tests" \
    --gtest_brief=1 --gtest_filter="$filter"
  rc=$?
  # memcheck ends with "ERROR SUMMARY: N errors", racecheck with
  # "RACECHECK SUMMARY: H hazards displayed (N errors, W warnings)".
  errs=$(grep -oE 'ERROR SUMMARY: [0-9]+ error|RACECHECK SUMMARY: [0-9]+ hazards displayed \([0-9]+ error' \
    "$out/sanitizer_$tool.log" | tail -1 | grep -oE '[0-9]+ error' | grep -oE '[0-9]+')
  if [[ $rc == 0 && $errs == 0 ]]; then record "$tool" PASS "0 errors"
  elif [[ $rc == 3 && -n $errs && $errs -gt 0 ]]; then
    record "$tool" FAIL "$errs errors (sanitizer_$tool.log)"; grep -m5 -E '^=+ (Invalid|Race|Error)' "$out/sanitizer_$tool.log"
  else
    record "$tool" INCONCLUSIVE "exit $rc$([[ $rc == 124 ]] && echo ' (time cap)'): $(grep -m1 -iE 'not supported|error' "$out/sanitizer_$tool.log" | cut -c1-160)"
  fi
done

log "done"
exit $failed
