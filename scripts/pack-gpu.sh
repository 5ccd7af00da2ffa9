#!/usr/bin/env bash
# Builds the CUDA binaries and packs them, with the conformance files, into gpu/ (ignored) for
# `device`: carry ["gpu"], then on the GPU machine `bash scripts/gpu.sh unpack ...`.
# The stripped binaries are packed because the carry limit is 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="$PWD/target-cuda"
cargo build --release --features cuda --bin kvplan
tests=$(cargo test --release --features cuda --test kvplan --no-run 2>&1 | sed -n 's/.*Executable.*(\(.*\))/\1/p')
mkdir -p gpu/bin
cp ../shared/conformance/*.jsonl gpu/ 2>/dev/null || true
strip -o gpu/bin/kvplan target-cuda/release/kvplan
strip -o gpu/bin/kvplan-tests "$tests"
tar -czf gpu/bins.tgz -C gpu/bin kvplan kvplan-tests
rm -rf gpu/bin
ls -la gpu/bins.tgz
