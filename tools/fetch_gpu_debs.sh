#!/usr/bin/env bash
# tools/fetch_gpu_debs.sh DIR: downloads (never installs) the Debian packages
# Xirang builds against, with the libraries they pull in, into DIR, for a
# GPU machine that cannot fetch them itself (tools/gpu_check.sh --debs DIR).
set -euo pipefail
dir="${1:?usage: tools/fetch_gpu_debs.sh DIR}"
mkdir -p "$dir"
pkgs=(libyaml-cpp-dev libyaml-cpp0.7 nlohmann-json3-dev libopenmpi-dev libopenmpi3 openmpi-bin openmpi-common
      libhwloc15 libevent-2.1-7 libevent-core-2.1-7 libevent-pthreads-2.1-7 libpmix2 libfabric1 libucx0 libpsm2-2
      libpsm-infinipath1 libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200 libhdf5-dev libhdf5-103-1
      libhdf5-cpp-103-1 libhdf5-hl-100 libsz2 libaec0 libcurl4 libopenblas-dev libopenblas0 libopenblas0-pthread
      libopenblas-pthread-dev libgfortran5 libpcre2-dev libpcre2-8-0 libgtest-dev libgmock-dev googletest pkg-config)
cd "$dir"
apt-get download "${pkgs[@]}"
du -sh .
