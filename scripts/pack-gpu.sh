#!/usr/bin/env bash
# Builds the CUDA binaries and packs them into gpu/ (ignored) for `device`: the `kvplan` tool and
# the integration-test binary, each stripped and xz-compressed (with LLVM linked in, two of them do
# not fit one call's 64 MiB). Carry ["gpu/tests.xz"] in one call with `scripts/gpu.sh stage`, then
# ["gpu"] (without tests.xz) in the next, while the machine is warm: `scripts/gpu.sh tests checks ...`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/cuda-toolchain.sh
export CARGO_TARGET_DIR="$PWD/target-cuda"
# One build for both: the test binary's features are the binary's.
tests=$(cargo test --release -p kvplan-tools --features cuda --test kvplan --no-run 2>&1 |
    tee /dev/stderr | sed -n 's/.*Executable.*(\(.*\))/\1/p')
mkdir -p gpu
strip -o gpu/kvplan target-cuda/release/kvplan
strip -o gpu/kvplan-tests "$tests"
xz -9 -T2 -f gpu/kvplan gpu/kvplan-tests
mv gpu/kvplan-tests.xz gpu/tests.xz
mv gpu/kvplan.xz gpu/bin.xz
# The model, in two parts (carry each with `scripts/gpu.sh stage` in its own call).
model=$(bash scripts/fetch-model.sh | tail -1)
split -n 2 -a 2 "$model" gpu/model.part-
ls -la gpu/
