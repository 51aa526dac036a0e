#!/usr/bin/env bash
# Faults a long run meets, tried as a user would (docs/reliability.md):
#   skip_dp2, skip_pp2   faults.kind=nan_grad poisons rank 1's gradient at step 3: every rank
#                        skips that update (the step-3 checkpoint's parameters equal step 2's,
#                        metrics.jsonl says skipped), and training goes on with finite losses.
#                        Under dp2 rank 0's gradient norm is its own and finite: it skips only
#                        because the ranks vote (under pp2 the stages sum the norm). Ranks that
#                        do not agree end up in different collectives: comm.timeout_s=10 ends
#                        such a run, and the case's own 45 s bound a hang (ctest's is 60 s)
#   limit_dp2, limit_pp2 the poison persists: the run stops after train.max_nonfinite_steps
#                        with one line naming the step, the parameter and the rank, exit 1,
#                        and every checkpoint left holds finite values only
#   lr_diverges          fp32 with train.lr=1e6 and no clipping stops with the line instead of
#                        training on NaN; no checkpoint holds a non-finite value
#   disk_full            checkpoints into a 3 MiB tmpfs: the save that does not fit ends the run
#                        with one line, exit 1 (no crash); the previous checkpoint stays latest,
#                        verifies and evaluates; no .tmp directory is left
#   disk_full_continue   the same with checkpoint.on_error=continue: a warning, training goes on
#   io_error             dp2, faults.kind=io_error: rank 1's write of the step-8 checkpoint fails
#                        halfway with EIO (rank 0's file is complete): one line naming rank 1 and
#                        the I/O error, exit 1; step 4 stays latest and verifies; no step 8, no .tmp
#   io_error_continue    the same with checkpoint.on_error=continue: a warning, the run finishes and
#                        step 12 is saved
#   read_only            a checkpoint into a tmpfs, which is then remounted read-only; the resumed
#                        run's save fails (EROFS): one line, exit 1; the previous checkpoint stays
#   damaged_shard        4 KiB of a shard overwritten with zeros: refused at open, naming the
#                        shard; data.verify=false trains on it
#   bad_config           the new keys' bad values: one config error line each
# Exit code 77: a case's tool is missing or mounting a tmpfs is not permitted (the reason is printed).
# Usage: faults_test.sh XIRANG_BINARY SOURCE_DIR WORK_DIR CASE
set -uo pipefail
xirang=$1 src=$2 work=$3 case=$4
mkdir -p "$work"
cd "$work" || exit 1

. "$src/tests/cli/lib.sh"

cfg=$src/configs/gpt2_debug.yaml
prepare_data() {
  [ -f data/debug/train/index.json ] && return
  "$xirang" data prepare --tokenizer bytes --out data/debug --force "$src/tests/assets/text/english.txt" \
    >/dev/null || die "data prepare failed"
}
data=(--set data.train=data/debug/train)
mpi=(env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -np 2 --oversubscribe)
# The non-finite cases' runs take a few seconds; ranks that stop agreeing fail within these bounds.
vote_bounds=(timeout 45) vote_sets=(--set comm.timeout_s=10)
# vote_rc RC: dies when the run hung (killed by vote_bounds).
vote_rc() { [ "$1" != 124 ] || die "the run hung (killed after 45 s): do the ranks still agree on the skip? $(tail -3 err.txt)"; }
need_mpirun() { command -v mpirun >/dev/null || { echo "skip [$case]: mpirun is not installed"; exit 77; }; }

# params_of CKPT_STEP_DIR OUT: the checkpoint's parameters as one safetensors file.
params_of() {
  rm -rf "$2"
  "$xirang" ckpt convert "$1" "$2/model.safetensors" >/dev/null 2>conv.err || die "export of $1 failed: $(cat conv.err)"
}

# all_finite FILE.safetensors: exits 0 when every F32 element is finite, else names the tensor.
all_finite() {
  python3 - "$1" <<'EOF'
import json, math, struct, sys
b = open(sys.argv[1], 'rb').read()
n = struct.unpack('<Q', b[:8])[0]
head = json.loads(b[8:8 + n])
base = 8 + n
for name, t in head.items():
    if name == '__metadata__': continue
    assert t['dtype'] == 'F32', t['dtype']
    s, e = t['data_offsets']
    vals = struct.unpack('<%df' % ((e - s) // 4), b[base + s:base + e])
    if not all(math.isfinite(v) for v in vals):
        print('non-finite values in', name); sys.exit(1)
EOF
}

# same_tensors A.safetensors B.safetensors: the same tensors, bitwise (the step in __metadata__ aside).
same_tensors() {
  python3 - "$1" "$2" <<'EOF'
import json, struct, sys
def load(path):
    b = open(path, 'rb').read()
    n = struct.unpack('<Q', b[:8])[0]
    head = json.loads(b[8:8 + n])
    head.pop('__metadata__', None)
    return head, b[8 + n:]
sys.exit(0 if load(sys.argv[1]) == load(sys.argv[2]) else 1)
EOF
}

# skipped_steps METRICS: the steps metrics.jsonl marks skipped, space-separated.
skipped_steps() { grep '"skipped":true' "$1" | sed 's/.*"step":\([0-9]*\),.*/\1/' | tr '\n' ' '; }

# The single poisoned step: every rank skips it, the run trains on.
skip_case() {
  need_mpirun
  prepare_data
  rm -rf ck m.jsonl
  "${vote_bounds[@]}" "${mpi[@]}" "$xirang" train "$cfg" "${data[@]}" "${vote_sets[@]}" "$@" --set train.steps=5 \
    --set checkpoint.dir=ck --set checkpoint.every=1 --set checkpoint.keep=10 --set metrics.jsonl=m.jsonl \
    --set faults.kind=nan_grad --set faults.rank=1 --set faults.step=3 >out.txt 2>err.txt
  rc=$?
  vote_rc $rc
  [ "$rc" = 0 ] || die "the run failed: $(grep -m 2 '^xirang: ' err.txt || tail -3 err.txt)"
  grep -q "injecting fault 'nan_grad' at step 3" err.txt || die "the fault was not injected: $(cat err.txt)"
  grep -qE "^step 3: update skipped .*non-finite gradient of parameter '[^']+' \(on rank 1\)" err.txt ||
    die "no skip line naming the parameter: $(cat err.txt)"
  [ "$(skipped_steps m.jsonl)" = "3 " ] || die "skipped steps '$(skipped_steps m.jsonl)', expected '3 '"
  [ "$(wc -l <m.jsonl)" = 5 ] || die "expected 5 metrics lines, got $(wc -l <m.jsonl)"
  ! grep -qiE '"loss":(nan|null|inf)' m.jsonl || die "a non-finite loss was logged: $(cat m.jsonl)"
  # Under dp2 rank 0 saw no NaN: it skipped only because the vote said so. Its parameters did not move.
  params_of ck/step_00000002 p2
  params_of ck/step_00000003 p3
  params_of ck/step_00000004 p4
  same_tensors p2/model.safetensors p3/model.safetensors || die "the parameters changed across the skipped step 3"
  same_tensors p3/model.safetensors p4/model.safetensors && die "the parameters did not change in step 4"
  all_finite p4/model.safetensors || die "step 4 holds non-finite parameters"
  echo "ok [$case]: step 3 skipped on every rank, parameters unchanged across it; training went on"
}

# The poison persists: the run stops at the limit with one line; every checkpoint is finite.
limit_case() {
  need_mpirun
  prepare_data
  rm -rf ck
  "${vote_bounds[@]}" "${mpi[@]}" "$xirang" train "$cfg" "${data[@]}" "${vote_sets[@]}" "$@" --set train.steps=10 \
    --set checkpoint.dir=ck --set checkpoint.every=1 --set checkpoint.keep=10 --set faults.kind=nan_grad \
    --set faults.rank=1 --set faults.step=3 --set faults.steps=100 >out.txt 2>err.txt
  rc=$?
  vote_rc $rc
  [ "$rc" = 1 ] || die "exit code $rc, expected 1: $(tail -3 err.txt)"
  [ "$(grep -c '^xirang: ' err.txt)" = 1 ] || die "expected one error line, got: $(grep '^xirang: ' err.txt)"
  grep -qE "^xirang: .*training stopped at step 5: 3 steps in a row skipped for non-finite values \(train\.max_nonfinite_steps=3\); the first, step 3: non-finite gradient of parameter '[^']+' \(on rank 1\)" err.txt ||
    die "unexpected error line: $(grep '^xirang: ' err.txt)"
  [ "$(cat ck/latest)" = step_00000004 ] || die "latest is '$(cat ck/latest)', expected step_00000004"
  for s in 2 3 4; do
    params_of ck/step_0000000$s p$s
    all_finite p$s/model.safetensors || die "checkpoint step $s holds non-finite values"
    "$xirang" ckpt inspect ck/step_0000000$s >insp.txt 2>&1 || die "step $s does not verify: $(tail -2 insp.txt)"
  done
  same_tensors p2/model.safetensors p4/model.safetensors || die "the parameters changed in the skipped steps 3-4"
  echo "ok [$case]: $(grep '^xirang: ' err.txt)"
}

# tmpfs_at DIR: a 3 MiB tmpfs at DIR, unmounted when the script exits; 77 where mounting is not permitted.
tmpfs_at() {
  mkdir -p "$1"
  mountpoint -q "$1" && umount "$1"
  if ! mount -t tmpfs -o size=3m tmpfs "$1" 2>mount.err; then
    echo "skip [$case]: cannot mount a tmpfs (needs root or CAP_SYS_ADMIN): $(cat mount.err)"
    exit 77
  fi
  trap "umount '$PWD/$1'" EXIT
}

# gpt2_debug with 2 layers: a checkpoint is ~1.1 MB, so the third (step 12) and the fourth do not fit in 3 MiB.
full_disk_run() {
  prepare_data
  tmpfs_at full
  "$xirang" train "$cfg" "${data[@]}" --set model.n_layer=2 --set train.steps=16 --set checkpoint.dir=full/ck \
    --set checkpoint.every=4 --set checkpoint.keep=5 "$@" >out.txt 2>err.txt
}

# The previous checkpoint is latest, verifies and evaluates; nothing partial is left.
check_previous_kept() {
  latest=$(cat full/ck/latest)
  [ -n "$latest" ] || die "no checkpoint was committed before the disk filled"
  "$xirang" ckpt inspect full/ck >insp.txt 2>&1 || die "the latest checkpoint does not verify: $(tail -3 insp.txt)"
  grep -q "full/ck/$latest" insp.txt || die "inspect did not read $latest: $(head -1 insp.txt)"
  "$xirang" eval "$cfg" "${data[@]}" --set data.val=data/debug/val --set model.n_layer=2 --checkpoint "full/ck/$latest" >eval.txt 2>eval.err ||
    die "eval of $latest failed: $(cat eval.err)"
  [ -z "$(ls -d full/ck/*.tmp 2>/dev/null)" ] || die "partial directories left: $(ls -d full/ck/*.tmp)"
}

case $case in
  skip_dp2) skip_case ;;
  skip_pp2) skip_case --set parallel.pp=2 ;;
  limit_dp2) limit_case ;;
  limit_pp2) limit_case --set parallel.pp=2 ;;
  lr_diverges)
    prepare_data
    rm -rf ck
    "$xirang" train "$cfg" "${data[@]}" --set train.lr=1e6 --set train.grad_clip=0 --set train.steps=30 \
      --set checkpoint.dir=ck --set checkpoint.every=1 --set checkpoint.keep=40 >out.txt 2>err.txt
    rc=$?
    [ "$rc" = 1 ] || die "exit code $rc, expected 1: $(tail -3 err.txt)"
    [ "$(grep -c '^xirang: ' err.txt)" = 1 ] || die "expected one error line, got: $(grep '^xirang: ' err.txt)"
    grep -qE "^xirang: .*(training stopped at step [0-9]+: 3 steps in a row skipped for non-finite values .*the first, step [0-9]+: non-finite (loss|gradient)|checkpoint step [0-9]+ not saved .*holds non-finite values)" err.txt ||
      die "unexpected error line: $(grep '^xirang: ' err.txt)"
    n=0
    for d in ck/step_????????; do
      [ -d "$d" ] || continue
      params_of "$d" p
      all_finite p/model.safetensors || die "$d holds non-finite values"
      n=$((n + 1))
    done
    echo "ok [$case]: $n checkpoints, all finite; $(grep '^xirang: ' err.txt)" ;;
  disk_full)
    full_disk_run
    rc=$?
    [ "$rc" = 1 ] || die "exit code $rc, expected 1 (>= 128 is a crash): $(tail -3 err.txt)"
    [ "$(grep -c '^xirang: ' err.txt)" = 1 ] || die "expected one error line, got: $(cat err.txt)"
    tail -n 1 err.txt | grep -qE "^xirang: checkpoint error: checkpoint step [0-9]+ not saved .*; latest stays .*full/ck/step_" ||
      die "unexpected error line: $(tail -n 1 err.txt)"
    check_previous_kept
    echo "ok [$case]: $latest kept; $(tail -n 1 err.txt)" ;;
  disk_full_continue)
    full_disk_run --set checkpoint.on_error=continue
    rc=$?
    [ "$rc" = 0 ] || die "exit code $rc, expected 0: $(tail -3 err.txt)"
    grep -qE "^warning: checkpoint step [0-9]+ not saved .*training goes on \(checkpoint\.on_error=continue\)" err.txt ||
      die "no warning: $(cat err.txt)"
    grep -q "trained to step 16 of 16" out.txt || die "the run did not finish: $(cat out.txt)"
    check_previous_kept
    echo "ok [$case]: $(grep -c '^warning: checkpoint' err.txt) failed saves warned; $latest kept" ;;
  io_error|io_error_continue)
    need_mpirun
    prepare_data
    rm -rf ck
    extra=()
    [ "$case" = io_error_continue ] && extra=(--set checkpoint.on_error=continue)
    "${mpi[@]}" "$xirang" train "$cfg" "${data[@]}" --set train.steps=12 --set checkpoint.dir=ck \
      --set checkpoint.every=4 --set checkpoint.keep=10 --set faults.kind=io_error --set faults.rank=1 \
      --set faults.step=8 "${extra[@]}" >out.txt 2>err.txt
    rc=$?
    grep -q "rank 1: injecting fault 'io_error' at step 8" err.txt || die "the fault was not injected: $(cat err.txt)"
    why="checkpoint step 8 not saved \(rank 1: .*write .*ck/step_00000008\.tmp/rank_00001\.h5\.tmp: Input/output error \(faults\.kind=io_error\)\); latest stays ck/step_00000004"
    if [ "$case" = io_error ]; then
      [ "$rc" = 1 ] || die "exit code $rc, expected 1 (>= 128 is a crash): $(tail -3 err.txt)"
      [ "$(grep -c '^xirang: ' err.txt)" = 1 ] || die "expected one error line, got: $(cat err.txt)"
      grep -qE "^xirang: (rank 0: )?checkpoint error: $why \(checkpoint\.on_error=continue would train on\)" err.txt ||
        die "unexpected error line: $(grep '^xirang: ' err.txt)"
      [ "$(cat ck/latest)" = step_00000004 ] || die "latest is '$(cat ck/latest)', expected step_00000004"
    else
      [ "$rc" = 0 ] || die "exit code $rc, expected 0: $(tail -3 err.txt)"
      grep -qE "^warning: $why; training goes on \(checkpoint\.on_error=continue\)" err.txt ||
        die "no warning: $(cat err.txt)"
      [ "$(cat ck/latest)" = step_00000012 ] || die "latest is '$(cat ck/latest)', expected step_00000012"
      "$xirang" ckpt inspect ck/step_00000012 >insp.txt 2>&1 || die "step 12 does not verify: $(tail -3 insp.txt)"
    fi
    [ ! -e ck/step_00000008 ] || die "the failed step 8 was committed"
    [ -z "$(ls -d ck/*.tmp 2>/dev/null)" ] || die "partial directories left: $(ls -d ck/*.tmp)"
    "$xirang" ckpt inspect ck/step_00000004 >insp.txt 2>&1 || die "step 4 does not verify: $(tail -3 insp.txt)"
    echo "ok [$case]: $(grep -E '^(xirang|warning): (rank 0: )?checkpoint' err.txt)" ;;
  read_only)
    prepare_data
    tmpfs_at full
    run=("$xirang" train "$cfg" "${data[@]}" --set model.n_layer=2 --set checkpoint.dir=full/ck --set checkpoint.every=4
         --set checkpoint.keep=5)
    "${run[@]}" --set train.steps=8 >out.txt 2>err.txt || die "the first run failed: $(tail -3 err.txt)"
    [ "$(cat full/ck/latest)" = step_00000008 ] || die "latest is '$(cat full/ck/latest)', expected step_00000008"
    mount -o remount,ro full 2>mount.err || { echo "skip [$case]: cannot remount the tmpfs read-only: $(cat mount.err)"; exit 77; }
    touch full/probe 2>/dev/null && die "the read-only remount still takes writes"
    "${run[@]}" --set train.steps=16 --set checkpoint.resume=auto >out.txt 2>err.txt
    rc=$?
    [ "$rc" = 1 ] || die "exit code $rc, expected 1 (>= 128 is a crash): $(tail -3 err.txt)"
    grep -q "resum.*step_00000008" out.txt err.txt || die "the second run did not resume from step 8: $(head -5 err.txt)"
    [ "$(grep -c '^xirang: ' err.txt)" = 1 ] || die "expected one error line, got: $(cat err.txt)"
    tail -n 1 err.txt | grep -qE "^xirang: checkpoint error: checkpoint step 12 not saved \(rank 0: .*[Rr]ead-only file system.*\); latest stays .*full/ck/step_00000008" ||
      die "unexpected error line: $(tail -n 1 err.txt)"
    check_previous_kept
    echo "ok [$case]: $latest kept; $(tail -n 1 err.txt)" ;;
  damaged_shard)
    prepare_data
    rm -rf damaged && cp -r data/debug damaged
    # 4 KiB of tokens (past the 64-byte header) overwritten with zeros: the file keeps its size.
    dd if=/dev/zero of=damaged/train/shard_00000.bin bs=1 seek=4096 count=4096 conv=notrunc status=none
    expect_error 1 "data error: .*damaged/train/shard_00000\.bin.* corrupt: checksum mismatch" -- \
      train "$cfg" --set data.train=damaged/train --set train.steps=2
    "$xirang" train "$cfg" --set data.train=damaged/train --set train.steps=2 --set data.verify=false >out.txt 2>err.txt ||
      die "data.verify=false did not train: $(tail -2 err.txt)" ;;
  bad_config)
    prepare_data
    expect_error 1 "config error: .*checkpoint\.on_error='sometimes' is not one of stop, continue" -- \
      train "$cfg" "${data[@]}" --set checkpoint.on_error=sometimes
    expect_error 1 "config error: .*train\.max_nonfinite_steps=0 must be >= 1" -- \
      train "$cfg" "${data[@]}" --set train.max_nonfinite_steps=0
    expect_error 1 "config error: .*faults\.steps=0 must be >= 1" -- \
      train "$cfg" "${data[@]}" --set faults.kind=nan_grad --set faults.step=1 --set faults.steps=0
    expect_error 1 "config error: .*data\.verify.*maybe" -- train "$cfg" "${data[@]}" --set data.verify=maybe ;;
  *) die "unknown case" ;;
esac
