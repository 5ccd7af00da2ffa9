#!/usr/bin/env bash
# The GPU session (run through `device`): conformance, tests, sanitizers and benchmarks on CUDA.
# `scripts/pack-gpu.sh` here first. Binaries wait in /tmp/kvplan-bin between calls of one warm
# machine. Logs go to $OUT; stdout ends with the tables.
# Usage: scripts/gpu.sh [stage|tests|checks|wide|sanitize|canary|plan|gather|nocupti|unfused]...
set -uo pipefail
BIN=/tmp/kvplan-bin/kvplan
TESTS=/tmp/kvplan-bin/kvplan-tests
OUT=${OUT:-/tmp/kvplan-gpu}
mkdir -p "$OUT" /tmp/kvplan-bin
[ -f gpu/tests.xz ] && xz -dc gpu/tests.xz > "$TESTS" && chmod +x "$TESTS"
[ -f gpu/bin.xz ] && xz -dc gpu/bin.xz > "$BIN" && chmod +x "$BIN"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
export KVPLAN_CONFORMANCE_DIR="$PWD/tests/data"
for part in "$@"; do
  case "$part" in
    stage) ;; # the binaries are unpacked above
    tests)
      # The integration tests on the CUDA suites (fused and unfused).
      "$TESTS" cuda --test-threads 4 > "$OUT/tests.txt" 2>&1
      grep -E "FAILED|panicked|test result" "$OUT/tests.txt"
      ;;
    checks)
      for backend in cuda cuda-unfused; do
        for file in gather plan canary; do
          "$BIN" check "tests/data/$file.jsonl" --backend "$backend" > "$OUT/check-$file-$backend.txt" 2>&1
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
          KVPLAN_WIDE_INDEX=1 "$BIN" check "tests/data/$file.jsonl" --backend "$backend" > "$OUT/wide-$file-$backend.txt" 2>&1
          echo "wide check $file $backend: $(tail -1 "$OUT/wide-$file-$backend.txt")"
        done
      done
      ;;
    sanitize)
      # compute-sanitizer's four tools over every conformance file; one summary line per tool.
      for tool in memcheck racecheck synccheck initcheck; do
        for file in gather plan canary; do
          KVPLAN_NO_CUPTI=1 compute-sanitizer --tool "$tool" --print-limit 20 \
            "$BIN" check "tests/data/$file.jsonl" --backend cuda-unfused > "$OUT/san-$tool-$file.txt" 2>&1
        done
        echo "$tool: $(grep -h "ERROR SUMMARY" "$OUT"/san-"$tool"-*.txt | tr '\n' ' ')"
      done
      ;;
    canary)
      "$BIN" bench canary --backend cuda --reps 20 2>&1 | tee "$OUT/bench-canary.txt"
      ;;
    nocupti)
      # Host-side views without CUPTI's per-launch cost (GPU columns are then empty).
      for which in plan gather; do
        KVPLAN_NO_CUPTI=1 "$BIN" bench "$which" --backend cuda --reps 50 2>&1 | tee "$OUT/bench-$which-nocupti.txt"
      done
      ;;
    unfused)
      for which in plan gather; do
        KVPLAN_NO_CUPTI=1 "$BIN" bench "$which" --backend cuda-unfused --reps 50 2>&1 | tee "$OUT/bench-$which-unfused.txt"
      done
      ;;
    plan|gather)
      "$BIN" bench "$part" --backend cuda --reps 50 2>&1 | tee "$OUT/bench-$part.txt"
      ;;
  esac
done
