#!/usr/bin/env bash
# The GPU session in one call (run through `device`): conformance, demo and benchmarks on CUDA.
# Run `scripts/pack-gpu.sh` here first, then carry `gpu/` (the packed CUDA binaries and a copy of
# ../shared/conformance). Logs go to $OUT; the last lines of stdout are the tables.
# Usage: scripts/gpu.sh [tests|checks|wide|canary|plan|gather|nocupti|unfused]...
set -uo pipefail
BIN=./target-cuda/release/kvplan
OUT=${OUT:-/tmp/kvplan-gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
mkdir -p target-cuda/release
tar -xzf gpu/bins.tgz -C target-cuda/release
for part in "$@"; do
  case "$part" in
    tests)
      # The integration tests on the CUDA suites (fused and unfused).
      KVPLAN_CONFORMANCE_DIR=gpu ./target-cuda/release/kvplan-tests cuda --test-threads 4 > "$OUT/tests.txt" 2>&1
      grep -E "FAILED|panicked|test result" "$OUT/tests.txt"
      ;;
    checks)
      for backend in cuda cuda-unfused; do
        for file in gather plan canary; do
          "$BIN" check "gpu/$file.jsonl" --backend "$backend" > "$OUT/check-$file-$backend.txt" 2>&1
          echo "check $file $backend: $(tail -1 "$OUT/check-$file-$backend.txt")"
        done
      done
      "$BIN" demo --backend cuda > "$OUT/demo.txt" 2>&1; tail -18 "$OUT/demo.txt"
      "$BIN" demo --backend cuda --inject-corruption > "$OUT/demo-inject.txt" 2>&1
      grep -E "inject|canary|PASS|FAIL" "$OUT/demo-inject.txt"
      ;;
    wide)
      # Every kernel on 64-bit indexes (KVPLAN_WIDE_INDEX=1 forces them on ordinary inputs).
      for backend in cuda cuda-unfused; do
        for file in gather plan canary; do
          KVPLAN_WIDE_INDEX=1 "$BIN" check "gpu/$file.jsonl" --backend "$backend" > "$OUT/wide-$file-$backend.txt" 2>&1
          echo "wide check $file $backend: $(tail -1 "$OUT/wide-$file-$backend.txt")"
        done
      done
      ;;
    canary)
      "$BIN" bench canary --backend cuda --reps 20 2>&1 | tee "$OUT/bench-canary.txt"
      KVPLAN_NO_CUPTI=1 "$BIN" bench canary-small --backend cuda --reps 50 2>&1 | tee "$OUT/bench-canary-nocupti.txt"
      ;;
    nocupti)
      # Host-side views without CUPTI's per-launch cost (GPU columns are then empty).
      for which in plan gather; do
        KVPLAN_NO_CUPTI=1 "$BIN" bench "$which" --backend cuda --reps 50 2>&1 | tee "$OUT/bench-$which-nocupti.txt"
      done
      ;;
    unfused)
      # The same grids on the unfused backend (CubeBackend directly), host-side views.
      for which in plan gather; do
        KVPLAN_NO_CUPTI=1 "$BIN" bench "$which" --backend cuda-unfused --reps 50 2>&1 | tee "$OUT/bench-$which-unfused.txt"
      done
      ;;
    plan|gather)
      "$BIN" bench "$part" --backend cuda --reps 50 2>&1 | tee "$OUT/bench-$part.txt"
      ;;
  esac
done
