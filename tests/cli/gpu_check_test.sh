#!/usr/bin/env bash
# tests/cli/gpu_check_test.sh XIRANG SOURCE_DIR WORK_DIR CASE: the GPU check's
# plumbing, proven without a GPU (tools/gpu_bundle.sh, tools/gpu_check.sh).
#
#   chroot     the bundle unpacked into an empty root that holds only what a
#              CUDA machine's image is assumed to have (glibc, libstdc++,
#              libgcc_s, the CUDA libraries: here this machine's toolkit
#              stands in for the image's): every bundled binary's libraries
#              resolve with ldd there, xirang trains on the CPU as one rank
#              (an Open MPI singleton) and as two under the bundle's own
#              relocated mpirun, and cuda_tests starts and skips for want of
#              a device. Nothing of the host's /usr is visible in that root.
#   dry_run    tools/gpu_check.sh --dry-run on the bundle: every step runs
#              its CPU equivalent, the archive and summary are written, the
#              exit status is 0; a bundle with a binary cut short fails the
#              check with status 1 and still leaves the archive.
#
# The cases share one bundle (WORK_DIR/bundle.tar.xz, remade when a binary is
# newer). Exit 77 (skip): a build without the CUDA tests or the NCCL tests,
# or a machine where this user cannot chroot and mount.
set -uo pipefail
xirang=$1 src=$2 work=$3 case=$4
source "$src/tests/cli/lib.sh"
build=$(cd "$(dirname "$xirang")/.." && pwd)
mkdir -p "$work" && cd "$work" || exit 1

for t in cuda_tests mpi_nccl_tests; do
  [[ -x $build/bin/$t ]] || { echo "skip [$case]: $build/bin/$t not built (no CUDA or NCCL here)"; exit 77; }
done
bundle=$work/bundle.tar.xz
if [[ ! -f $bundle || $build/bin/xirang -nt $bundle || $build/bin/cuda_tests -nt $bundle ||
      $src/tools/gpu_bundle.sh -nt $bundle ]]; then
  "$src/tools/gpu_bundle.sh" --no-build --build "$build" --out "$bundle" --level 0 >bundle.log 2>&1 ||
    die "gpu_bundle.sh failed: $(tail -3 bundle.log)"
fi

case $case in
chroot)
  [[ $(id -u) == 0 ]] || { echo "skip [$case]: chroot and mount need root"; exit 77; }
  root=$(mktemp -d "$work/root.XXXX")
  mounts=()
  cleanup() {
    local m
    for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount -l "${mounts[i]}" 2>/dev/null; done
    rm -rf "$root"
  }
  trap cleanup EXIT
  mkdir -p "$root"/{proc,dev/shm,tmp,lib64,base,cuda,work,bin}
  mount -t proc proc "$root/proc" || { echo "skip [$case]: cannot mount proc here"; exit 77; }
  mounts+=("$root/proc")
  mount -t tmpfs tmpfs "$root/dev/shm" && mounts+=("$root/dev/shm")
  touch "$root/dev/null" && mount --bind /dev/null "$root/dev/null" && mounts+=("$root/dev/null")
  tar -C "$root" -xJf "$bundle" || die "cannot unpack the bundle"
  # The image's share: the loader, glibc, the C++ runtime; and the CUDA
  # libraries (the toolkit's, read-only through a bind mount).
  cp -L /lib64/ld-linux-x86-64.so.2 "$root/lib64/"
  for l in libc.so.6 libm.so.6 libdl.so.2 libpthread.so.0 librt.so.1 libresolv.so.2 libutil.so.1 \
           libstdc++.so.6 libgcc_s.so.1; do
    f=$(ldconfig -p | awk -v n="$l" '$1 == n && /x86-64/ {print $NF; exit}')
    [[ -n $f ]] && cp -L "$f" "$root/base/"
  done
  cudalib=$(dirname "$(readlink -f "$(ldconfig -p | awk '$1 == "libcublas.so.13" {print $NF; exit}')" 2>/dev/null)" 2>/dev/null)
  [[ -d $cudalib ]] || cudalib=$(dirname "$(readlink -f /usr/local/cuda/lib64/libcublas.so.13)")
  ncclib=$(dirname "$(readlink -f "$(ldd "$build/bin/xirang" | awk '/libnccl/ {print $3}')")")
  mount --bind -o ro "$cudalib" "$root/cuda" && mounts+=("$root/cuda") || die "cannot bind $cudalib"
  mkdir -p "$root/nccl" && mount --bind -o ro "$ncclib" "$root/nccl" && mounts+=("$root/nccl")
  chroot=$(command -v chroot) || { echo "skip [$case]: no chroot command"; exit 77; }
  B=/xirang-gpu M=/xirang-gpu/usr/lib/x86_64-linux-gnu
  ld="/base:$M:$M/openblas-openmp:$M/hdf5/serial:$M/openmpi/lib:/cuda:/nccl"
  inroot() {
    env -i PATH="$B/usr/bin:$B/bin" LD_LIBRARY_PATH="$ld" OPAL_PREFIX="$B/usr" HOME=/tmp TMPDIR=/tmp \
      OMPI_MCA_ess_singleton_isolated=1 OMPI_MCA_plm=isolated OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
      OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1 "$chroot" "$root" "$@"
  }
  # ldd is a script of the host's; the root's own loader lists what it maps.
  for b in xirang cuda_tests mpi_nccl_tests; do
    inroot /lib64/ld-linux-x86-64.so.2 --list "$B/bin/$b" >"ldd_$b.txt" 2>&1 ||
      die "the root's loader cannot list $b's libraries: $(tail -3 "ldd_$b.txt")"
    ! grep -q "not found" "ldd_$b.txt" || die "$b: $(grep 'not found' "ldd_$b.txt" | head -3 | tr '\n' ' ')"
    grep -qE '=> /(usr|lib)/' "ldd_$b.txt" && die "$b maps a library from outside the root's own dirs: $(grep -E '=> /(usr|lib)/' "ldd_$b.txt" | head -2)"
  done
  # A tiny corpus, prepared and trained on inside the root.
  head -c 60000 "$src/README.md" >"$root/work/text.txt"
  inroot "$B/bin/xirang" data prepare --tokenizer bytes --force --val-fraction 0.1 --out /work/data /work/text.txt \
    >prepare.log 2>&1 || die "data prepare in the root: $(tail -3 prepare.log)"
  cp "$src/configs/gpt2_debug.yaml" "$root/work/"
  train_args=(train /work/gpt2_debug.yaml --set data.train=/work/data/train --set train.steps=3)
  inroot "$B/bin/xirang" "${train_args[@]}" --set metrics.jsonl=/work/one.jsonl >one.log 2>&1 ||
    die "one-rank training in the root: $(tail -3 one.log)"
  inroot "$B/usr/bin/mpirun" -np 2 "$B/bin/xirang" "${train_args[@]}" --set metrics.jsonl=/work/two.jsonl \
    >two.log 2>&1 || die "two ranks under the bundle's mpirun in the root: $(tail -5 two.log)"
  [[ $(wc -l <"$root/work/one.jsonl") == 3 && $(wc -l <"$root/work/two.jsonl") == 3 ]] ||
    die "expected 3 metrics lines from each run"
  # Same data, seed and global batch: dp=2 trains to one rank's losses (fp32, 1e-5 relative).
  python3 - "$root/work/one.jsonl" "$root/work/two.jsonl" <<'EOF' || die "dp=2 losses differ from one rank's"
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:3])
sys.exit(0 if all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(a, b)) else 1)
EOF
  inroot "$B/bin/cuda_tests" --gtest_filter='*Matmul*' --gtest_brief=1 >cuda_tests.log 2>&1 ||
    die "cuda_tests in the root: $(tail -3 cuda_tests.log)"
  grep -q "SKIPPED" cuda_tests.log || die "cuda_tests did not skip without a device"
  echo "ok [$case]: every bundled binary resolves in a root of glibc, libstdc++ and CUDA alone; 1 and 2 ranks trained"
  ;;
dry_run)
  command -v python3 >/dev/null || { echo "skip [$case]: python3 is missing"; exit 77; }
  rm -rf out && mkdir out
  OUT=$work/out "$src/tools/gpu_check.sh" --bundle "$bundle" --dry-run --out "$work/check" --budget 600 \
    >check.log 2>&1
  rc=$?
  [[ $rc == 0 ]] || die "the dry run exited $rc: $(tail -12 check.log)"
  [[ -s out/gpu_check.tar.gz && -s out/summary.txt ]] || die "no archive or summary in \$OUT"
  listing=$(tar -tzf out/gpu_check.tar.gz)
  for f in summary.txt cuda_tests.log parity.txt speed.txt observe.txt gpt2_debug_fp32_gpu.jsonl llama_debug_bf16_cpu.jsonl; do
    grep -q "/$f\$" <<<"$listing" || die "the archive lacks $f"
  done
  for step in libraries kernels parity speed nccl observe; do
    grep -q "^PASS $step" out/summary.txt || die "step $step did not pass: $(grep " $step" out/summary.txt)"
  done
  grep -q "^SKIP peer" out/summary.txt || die "the PyTorch peer should be skipped in a dry run"
  grep -q "^SKIP nccl_paths" out/summary.txt || die "comm.nccl_alone should be skipped in a dry run"
  # A bundle whose xirang is cut short: the check fails, the archive is still written.
  mkdir -p broken && tar -C broken -xJf "$bundle" &&
    head -c 4096 broken/xirang-gpu/bin/xirang >broken/x && mv broken/x broken/xirang-gpu/bin/xirang &&
    chmod +x broken/xirang-gpu/bin/xirang && XZ_OPT=-0 tar -C broken -cJf broken.tar.xz xirang-gpu || die "cannot make the broken bundle"
  rm -rf out2 && mkdir out2
  OUT=$work/out2 "$src/tools/gpu_check.sh" --bundle broken.tar.xz --dry-run --out "$work/check2" --only kernels,parity \
    >check2.log 2>&1
  rc=$?
  [[ $rc == 1 ]] || die "a broken bundle exited $rc, expected 1: $(tail -5 check2.log)"
  [[ -s out2/gpu_check.tar.gz ]] || die "no archive after a failed check"
  grep -q "^FAIL parity" out2/summary.txt || die "the failed training is not reported: $(tail -5 out2/summary.txt)"
  echo "ok [$case]: dry run passes with its archive; a broken bundle fails with status 1 and keeps the archive"
  ;;
*) die "unknown case" ;;
esac
