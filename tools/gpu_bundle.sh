#!/usr/bin/env bash
# tools/gpu_bundle.sh: builds what the GPU check runs and packs it, with the
# run-time libraries a CUDA machine's image may lack, into one archive that
# a device call carries (tools/gpu_check.sh --bundle FILE unpacks and runs it).
#
#   tools/gpu_bundle.sh [--build DIR] [--out FILE] [--no-build] [--level N]
#
# Built here, not there: a device lease is minutes long and a cold CUDA build
# of Xirang takes longer than that on any machine. The archive holds
#   bin/      xirang, cuda_tests, mpi_nccl_tests, attention_cuda_bench (stripped, sm_90 unless
#             XIRANG_CUDA_ARCHS says otherwise)
#   usr/...   every shared library they load that is not part of the base
#             system or the CUDA stack, at its Debian path; Open MPI's
#             launcher, plugins and help files likewise, so OPAL_PREFIX can
#             relocate it
#   MANIFEST  the commit, the libraries and where each came from
# Left out on purpose: glibc, libstdc++ and libgcc_s (every image has them,
# newer is compatible), the driver (libcuda, libnvidia-ml) and the CUDA
# libraries (cudart, cuBLAS, cuBLASLt, cuDNN, NCCL: hundreds of MiB, and the
# image ships the same major versions; gpu_check.sh finds them there).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$root/build-gpu" out="" do_build=1 level=6
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) build="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --no-build) do_build=0; shift ;;
    --level) level="$2"; shift 2 ;;  # xz's: 6 for a lease (smaller), 0 for tests (faster)
    *) echo "gpu_bundle: unknown argument '$1' (expected --build DIR, --out FILE, --no-build, --level N)" >&2; exit 2 ;;
  esac
done
out="${out:-$build/bundle/xirang-gpu.tar.xz}"
targets=(xirang cuda_tests mpi_nccl_tests attention_cuda_bench)

if [[ $do_build == 1 ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
  if [[ ! -f "$build/build.ninja" ]]; then
    cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DXIRANG_CUDA=ON \
      -DXIRANG_CUDA_ARCHS="${XIRANG_CUDA_ARCHS:-90}" >/dev/null
  fi
  cmake --build "$build" -j "${XIRANG_JOBS:-$(nproc)}" --target "${targets[@]}"
fi
for t in "${targets[@]}"; do
  [[ -x "$build/bin/$t" ]] || { echo "gpu_bundle: $build/bin/$t is missing (build it, or drop --no-build)" >&2; exit 1; }
done

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
top="$stage/xirang-gpu"
mkdir -p "$top/bin"
for t in "${targets[@]}"; do
  cp "$build/bin/$t" "$top/bin/$t"
  strip --strip-unneeded "$top/bin/$t"
done

# A library is "base" when every Linux image with a C++ toolchain and the
# NVIDIA driver has it; "cuda" when the CUDA machine's image provides it.
is_left_out() {
  case "$(basename "$1")" in
    linux-vdso.so* | ld-linux-x86-64.so* | libc.so* | libm.so* | libdl.so* | libpthread.so* | librt.so* | \
      libresolv.so* | libutil.so* | libstdc++.so* | libgcc_s.so*) return 0 ;;
    libcuda.so* | libnvidia-*.so* | libcudart.so* | libcublas.so* | libcublasLt.so* | libcudnn*.so* | libnccl.so*)
      return 0 ;;
  esac
  return 1
}

# Copies a file to its own path under the stage, symbolic links included
# (the soname link and the file it points to).
carry() {
  local f="$1" dest target
  f="$(cd "$(dirname "$f")" && pwd -P)/$(basename "$f")"  # /lib/... and /usr/lib/... are one place
  dest="$top$f"
  [[ -e "$dest" || -L "$dest" ]] && return 0
  mkdir -p "$(dirname "$dest")"
  if [[ -L "$f" ]]; then
    cp -P "$f" "$dest"
    target=$(readlink "$f")
    [[ $target == /* ]] || target="$(dirname "$f")/$target"
    carry "$target"
  else
    cp "$f" "$dest"
  fi
}

# The libraries one ELF file needs, transitively (ldd already is), that are
# not left out.
carry_deps() {
  local elf="$1" line lib
  while read -r line; do
    if [[ $line == *"not found"* ]]; then
      echo "gpu_bundle: $(basename "$elf") needs ${line%% *}, which this machine lacks" >&2
      return 1
    fi
    lib=$(awk '/=>/ {print $3}' <<<"$line")
    [[ -n $lib && -e $lib ]] || continue
    is_left_out "$lib" && continue
    carry "$lib"
  done < <(ldd "$elf")
}

for t in "${targets[@]}"; do carry_deps "$build/bin/$t"; done

# Open MPI, relocatable through OPAL_PREFIX: the launcher (mpirun is a link
# to orterun), the plugins, the help texts, and PMIx's plugins. Plugins for
# fabrics a one-node check never uses (InfiniBand, UCX, OFI, PSM) would drag
# in their libraries and warn when those are absent: they stay behind.
ompi_lib=/usr/lib/x86_64-linux-gnu/openmpi
if [[ -d $ompi_lib ]]; then
  # The launchers as files (Debian's mpirun is a link through
  # /etc/alternatives, an absolute path that would not survive the move).
  mkdir -p "$top/usr/bin"
  for f in orterun mpirun orted; do [[ -e /usr/bin/$f ]] && cp -L "/usr/bin/$f" "$top/usr/bin/$f"; done
  carry_deps /usr/bin/orterun
  while IFS= read -r -d '' f; do
    case "$(basename "$f")" in
      *openib* | *ucx* | *ofi* | *psm* | *uct* | *verbs* | *portals* | *usnic* | *cuda* | *hcoll* | *fca* | *ucc*)
        continue ;;
    esac
    carry "$f"
    [[ $f == *.so ]] && carry_deps "$f"
  done < <(find "$ompi_lib" -path "$ompi_lib/include" -prune -o \( -type f -o -type l \) ! -name "*.a" -print0)
  for d in /usr/share/openmpi /usr/share/pmix /usr/lib/x86_64-linux-gnu/pmix2 /etc/openmpi; do
    [[ -d $d ]] || continue
    while IFS= read -r -d '' f; do
      carry "$f"
      [[ $f == *.so ]] && carry_deps "$f"
    done < <(find "$d" \( -type f -o -type l \) ! -name "*.a" ! -name "*.h" -print0)
  done
fi

{
  echo "commit $(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)$(git -C "$root" diff --quiet 2>/dev/null || echo ' (modified tree)')"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME"), CUDA archs ${XIRANG_CUDA_ARCHS:-90}"
  echo "binaries:"
  for t in "${targets[@]}"; do echo "  bin/$t $(stat -c %s "$top/bin/$t")"; done
  echo "libraries (needed by the binaries; left out: glibc, libstdc++, libgcc_s, the driver, the CUDA libraries):"
  (cd "$top" && find usr etc -type f -name '*.so*' 2>/dev/null | sort | sed 's/^/  \//')
} >"$top/MANIFEST"

mkdir -p "$(dirname "$out")"
tar -C "$stage" -cf - xirang-gpu | xz -T0 -"$level" >"$out.tmp"
mv "$out.tmp" "$out"
echo "gpu_bundle: $out, $(du -h "$out" | cut -f1) ($(du -sh "$top" | cut -f1) unpacked)"
