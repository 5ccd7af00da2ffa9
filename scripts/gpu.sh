#!/usr/bin/env bash
# The GPU session (run through `device`): conformance, tests, sanitizers and benchmarks on CUDA.
# `scripts/pack-gpu.sh` here first. Binaries wait in /tmp/kvplan-bin between calls of one warm
# machine. Logs go to $OUT; stdout ends with the tables.
# The model travels in parts (over one call's 64 MiB): `scripts/pack-gpu.sh` also splits it into
# gpu/model.part-*; carry one part per call with `stage`, they are joined in /tmp/kvplan-bin.
# Usage: scripts/gpu.sh [stage|wrap|tests|checks|wide|sanitize|fuzz|canary|plan|gather|host|host-ab|extension|ab|ncu-ab|nocupti|unfused|decode|decode-ab|decode-builds|decode-prompts|decode-check|peers-build|peers|peers-hf|peers-gputime|decode-dtypes|gputime|ncu-decode|sanitize-graphs|profile-ab|repeat|repeat-ab|anchor|profile]...
set -uo pipefail
BIN=${BIN:-/tmp/kvplan-bin/kvplan}
TESTS=/tmp/kvplan-bin/kvplan-tests
OUT=${OUT:-/tmp/kvplan-gpu}
mkdir -p "$OUT" /tmp/kvplan-bin
[ -f gpu/tests.xz ] && xz -dc gpu/tests.xz > "$TESTS" && chmod +x "$TESTS"
[ -f gpu/bin.xz ] && xz -dc gpu/bin.xz > "$BIN" && chmod +x "$BIN"
# The Burn 0.21 build of the last pre-port main (099ad25), for the A/B (`scripts/pack-gpu.sh ab`).
BIN021=/tmp/kvplan-bin/kvplan-021
[ -f gpu/bin021.xz ] && xz -dc gpu/bin021.xz > "$BIN021" && chmod +x "$BIN021"
# A baseline build for `decode-ab` (`scripts/pack-gpu.sh old REV`).
BINOLD=/tmp/kvplan-bin/kvplan-old
[ -f gpu/binold.xz ] && xz -dc gpu/binold.xz > "$BINOLD" && chmod +x "$BINOLD"
# Named builds for `decode-builds` (gpu/bin-NAME.xz -> /tmp/kvplan-bin/kvplan-NAME).
for packed in gpu/bin-*.xz; do
  [ -f "$packed" ] || continue
  name=${packed#gpu/bin-}; name=${name%.xz}
  xz -dc "$packed" > "/tmp/kvplan-bin/kvplan-$name" && chmod +x "/tmp/kvplan-bin/kvplan-$name"
done
for part in gpu/model.part-*; do [ -f "$part" ] && cp "$part" /tmp/kvplan-bin/; done
MODEL=/tmp/kvplan-bin/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$MODEL" ] && [ -f /tmp/kvplan-bin/model.part-aa ] && [ -f /tmp/kvplan-bin/model.part-ab ]; then
  cat /tmp/kvplan-bin/model.part-* > "$MODEL"
fi
# Or the model xz-compressed in two parts (`scripts/pack-gpu.sh model-xz`): the first small enough
# to travel with gpu/bin.xz, so a fresh machine runs after two calls.
for part in gpu/mx.part-*; do [ -f "$part" ] && cp "$part" /tmp/kvplan-bin/; done
if [ ! -f "$MODEL" ] && [ -f /tmp/kvplan-bin/mx.part-aa ] && [ -f /tmp/kvplan-bin/mx.part-ab ]; then
  cat /tmp/kvplan-bin/mx.part-* | xz -dc > "$MODEL"
fi
export KVPLAN_MODEL="$MODEL"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
export KVPLAN_CONFORMANCE_DIR="$PWD/tests/data"
for part in "$@"; do
  case "$part" in
    stage) ;; # the binaries are unpacked above
    wrap)
      # Named builds that are another build with knobs set, for `decode-builds`: WRAPS holds
      # `NAME=BUILD:VAR=VALUE,VAR=VALUE` entries (e.g. `b16=blk3:KVPLAN_PROJECTION_MAX_TOKENS=16`).
      for entry in ${WRAPS:-}; do
        name=${entry%%=*}; rest=${entry#*=}; build=${rest%%:*}; vars=${rest#*:}
        printf '#!/bin/sh\nexec env %s /tmp/kvplan-bin/kvplan-%s "$@"\n' "${vars//,/ }" "$build" \
          > "/tmp/kvplan-bin/kvplan-$name"
        chmod +x "/tmp/kvplan-bin/kvplan-$name"
        echo "wrap $name: $(tail -1 "/tmp/kvplan-bin/kvplan-$name")"
      done
      ;;
    tests)
      # The integration tests on the CUDA suites (fused and unfused).
      # The capture test alone: CUDA's global capture mode refuses other threads' syncs meanwhile.
      "$TESTS" cuda --test-threads 4 --skip paged_capture > "$OUT/tests.txt" 2>&1
      "$TESTS" paged_capture --test-threads 1 >> "$OUT/tests.txt" 2>&1
      grep -E "FAILED|panicked|test result" "$OUT/tests.txt"
      ;;
    checks)
      for backend in cuda cuda-unfused; do
        for file in gather plan canary slots; do
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
        for file in gather plan canary slots; do
          KVPLAN_WIDE_INDEX=1 "$BIN" check "tests/data/$file.jsonl" --backend "$backend" > "$OUT/wide-$file-$backend.txt" 2>&1
          echo "wide check $file $backend: $(tail -1 "$OUT/wide-$file-$backend.txt")"
        done
      done
      ;;
    sanitize)
      # compute-sanitizer's four tools over every conformance file (cuda-unfused: one launch per
      # kernel) and over the unfused CUDA integration suite (fuzz and thread tests aside: they
      # repeat the same kernels for minutes under a sanitizer); one summary line per tool.
      # SANITIZE_SECONDS bounds each suite run (default 150).
      for tool in memcheck racecheck synccheck initcheck; do
        for file in gather plan canary slots; do
          KVPLAN_NO_CUPTI=1 compute-sanitizer --tool "$tool" --print-limit 20 \
            "$BIN" check "tests/data/$file.jsonl" --backend cuda-unfused > "$OUT/san-$tool-$file.txt" 2>&1
        done
        KVPLAN_NO_CUPTI=1 timeout "${SANITIZE_SECONDS:-150}" compute-sanitizer --tool "$tool" --print-limit 20 \
          "$TESTS" cuda_unfused:: --skip fuzz_ --skip concurrency_ --test-threads 1 > "$OUT/san-$tool-tests.txt" 2>&1
        echo "$tool: $(for f in gather plan canary slots tests; do
          printf '%s: %s; ' "$f" "$(grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$OUT/san-$tool-$f.txt" | tail -1)"; done)"
        echo "  checks: $(for f in gather plan canary slots; do printf '%s %s; ' "$f" "$(grep -ho '[0-9]* passed, [0-9]* failed' "$OUT/san-$tool-$f.txt" | tail -1)"; done)"
        echo "  tests: $(grep -h "test result" "$OUT/san-$tool-tests.txt" | tail -1) $(grep -c '^test .* ok$' "$OUT/san-$tool-tests.txt") ok lines"
      done
      ;;
    sanitize-graphs)
      # memcheck over a decode whose steps are captured and replayed as graphs (--graphs on).
      KVPLAN_NO_CUPTI=1 timeout "${SANITIZE_SECONDS:-240}" compute-sanitizer --tool memcheck --print-limit 20 \
        "$BIN" generate --backend cuda --no-warm-up --graphs on --spec off --batch 2 --limit 2 \
        --max-new-tokens 8 --ignore-eos --file benches/prompts.txt > "$OUT/san-graphs.txt" 2>&1
      echo "memcheck, graphs on: $(grep -h 'ERROR SUMMARY' "$OUT/san-graphs.txt" | tail -1); $(grep -h '^generate: [0-9]* requests' "$OUT/san-graphs.txt" | cut -c1-90)"
      ;;
    fuzz)
      # Differential fuzzing against the reference on both CUDA backends.
      for backend in cuda cuda-unfused; do
        "$BIN" fuzz --seed 19 --cases "${FUZZ_CASES:-500}" --backend "$backend" > "$OUT/fuzz-$backend.txt" 2>&1
        echo "fuzz $backend (rc $?): $(grep -E '^[a-z]+: .* disagreements|^[0-9]+ cases' "$OUT/fuzz-$backend.txt" | tr '\n' ';')"
      done
      ;;
    canary)
      "$BIN" bench canary --backend cuda --reps 20 2>&1 | tee "$OUT/bench-canary.txt"
      ;;
    ncu-ab)
      # The kernels the A/B found slower on 0.22 (segment gather (4096, 2048), the canary's
      # prefill write), one launch each under Nsight Compute, on both builds: time, registers,
      # occupancy, throughput.
      for build in ${NCU_BUILDS:-021 022}; do
        bin="$BIN"; [ "$build" = 021 ] && bin="$BIN021"
        KVPLAN_NO_CUPTI=1 KVPLAN_BENCH_SHAPE=4096x2048 ncu --clock-control none --section SpeedOfLight \
          --section LaunchStats --section Occupancy -k regex:segment -c 1 \
          "$bin" bench gather --backend cuda --reps 2 > "$OUT/ncu-segment-$build.txt" 2>&1
        KVPLAN_NO_CUPTI=1 KVPLAN_BENCH_SHAPE=32x2048 ncu --clock-control none --section SpeedOfLight \
          --section LaunchStats --section Occupancy -k regex:write -c 1 \
          "$bin" bench canary --backend cuda --reps 2 > "$OUT/ncu-write-$build.txt" 2>&1
        for kernel in segment write; do
          echo "== $kernel $build: $(grep -E '^  [a-z_]+.*\(' "$OUT/ncu-$kernel-$build.txt" | head -1 | cut -c1-60)"
          grep -E "^    (Duration|Registers Per Thread|Achieved Occupancy|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Block Limit Registers|Static Shared Memory Per Block|Grid Size|Block Size)" "$OUT/ncu-$kernel-$build.txt"
        done
      done
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
    decode-check)
      # The model is right on the GPU: greedy parity of the three drafting modes, in f64 (the
      # test's dtype: no near-tie flips between reduction orders) and in f32 (what is served);
      # correctness only, so no warm-up; every step drafts (--spec-max-tokens 0). Compiled kernels
      # kept between the runs (keyed by build).
      [ -f cubecl.toml ] || printf '[compilation]\ncache = true\n' > cubecl.toml
      # DTYPES set empty: the injected faults only.
      for dtype in ${DTYPES-f64 f32}; do
        for spec in off ngram self; do
          "$BIN" generate --backend cuda --no-warm-up --dtype "$dtype" --spec "$spec" --spec-max-tokens 0 --max-new-tokens 48 --json --limit 6 \
            --file benches/prompts.txt > "$OUT/parity-$dtype-$spec.jsonl" 2> "$OUT/parity-$dtype-$spec.err"
          echo "$dtype $spec: $(tail -1 "$OUT/parity-$dtype-$spec.err")"
        done
        # Spec off again with the graphs off (on by default on CUDA): the eager steps' tokens.
        "$BIN" generate --backend cuda --no-warm-up --dtype "$dtype" --spec off --graphs off --max-new-tokens 48 --json --limit 6 \
          --file benches/prompts.txt > "$OUT/parity-$dtype-eager.jsonl" 2> "$OUT/parity-$dtype-eager.err"
        for spec in ngram self eager; do
          cmp -s <(python3 -c "import json,sys;[print(json.loads(l)['tokens']) for l in open(sys.argv[1])]" "$OUT/parity-$dtype-off.jsonl") \
                 <(python3 -c "import json,sys;[print(json.loads(l)['tokens']) for l in open(sys.argv[1])]" "$OUT/parity-$dtype-$spec.jsonl") \
            && echo "parity $dtype off=$spec: equal" || echo "parity $dtype off=$spec: DIFFERENT"
        done
      done
      "$BIN" generate --backend cuda --no-warm-up --spec ngram --spec-max-tokens 0 --max-new-tokens 32 --limit 4 --json \
        --file benches/prompts.txt > "$OUT/inject-clean.jsonl" 2> "$OUT/inject-clean.err"
      for kind in kv-byte stale-row; do
        "$BIN" generate --backend cuda --no-warm-up --spec ngram --spec-max-tokens 0 --max-new-tokens 32 --limit 4 --json \
          --file benches/prompts.txt --inject-corruption "$kind" > "$OUT/inject-$kind.jsonl" 2> "$OUT/inject-$kind.err"
        grep -h "inject-corruption" "$OUT/inject-$kind.err"
        python3 - "$OUT/inject-clean.jsonl" "$OUT/inject-$kind.jsonl" <<'PY'
import json, sys
clean, hit = ([json.loads(l) for l in open(f)] for f in sys.argv[1:3])
for c, h in zip(clean, hit):
    tag = "victim" if h["canary_violations"] else "other"
    print(f"  {tag}: {'unchanged' if c['tokens'] == h['tokens'] else 'CHANGED'} {h['canary_violations']}")
PY
      done
      "$BIN" generate --backend cuda --no-warm-up "What is the capital of France?" 2>&1 | tail -3
      # bf16 answers too (its greedy tokens are not claimed equal across modes: 8-bit roundings).
      "$BIN" generate --backend cuda --no-warm-up --dtype bf16 "Who wrote Romeo and Juliet?" 2>&1 | tail -3
      ;;
    decode-dtypes)
      # Tokens/s of f32 against bf16, spec off, 128 new tokens, graphs on, after warm-up;
      # BATCHES picks rows.
      [ -f cubecl.toml ] || printf '[compilation]\ncache = true\n' > cubecl.toml
      for bs in ${BATCHES:-1 8 32}; do
        limit=$bs; [ "$bs" = 1 ] && limit=4
        for variant in f32 bf16; do
          log="$OUT/dtypes-$variant-$bs"
          timeout "${RUN_TIMEOUT:-0}" "$BIN" generate --backend cuda --spec off --dtype "$variant" --batch "$bs" \
            --limit "$limit" --max-new-tokens 128 --ignore-eos --json --file benches/prompts.txt > "$log.jsonl" 2> "$log.err"
          echo "$variant,$bs,$(grep -h '^generate: [0-9]* requests' "$log.err" | cut -c1-120)"
          if grep -q '^graphs:' "$log.err"; then echo "ERROR: $variant,$bs: a capture fell back"; fi
        done
      done
      ;;
    decode-builds)
      # Tokens/s of several builds side by side (BUILDS names /tmp/kvplan-bin/kvplan-NAME), the
      # order rotated row by row; 128 new tokens, graphs as each build defaults (on, on CUDA).
      [ -f cubecl.toml ] || printf '[compilation]\ncache = true\n' > cubecl.toml
      read -ra names <<< "${BUILDS:-main}"
      row=0
      for bs in ${BATCHES:-1 8 32}; do
        limit=$bs; [ "$bs" = 1 ] && limit=4
        for spec in ${SPECS:-off ngram10}; do
          k=4; mode=$spec; [ "$spec" = ngram10 ] && k=10 && mode=ngram
          count=${#names[@]}
          for ((i = 0; i < count; i++)); do
            name=${names[$(((i + row) % count))]}
            log="$OUT/builds-$name-$spec-$bs"
            # RUN_TIMEOUT (seconds) bounds each run, so one slow warm-up does not take the call.
            timeout "${RUN_TIMEOUT:-0}" "/tmp/kvplan-bin/kvplan-$name" generate --backend cuda --spec "$mode" --draft-tokens "$k" ${ARGS:-} --batch "$bs" \
              --limit "$limit" --max-new-tokens 128 --ignore-eos --json --file benches/prompts.txt > "$log.jsonl" 2> "$log.err"
            echo "$name,$spec,$bs,$(grep -h '^generate: [0-9]* requests' "$log.err" | cut -c1-150)"
            if grep -q '^graphs:' "$log.err"; then echo "ERROR: $name,$spec,$bs: a capture fell back"; fi
          done
          row=$((row + 1))
        done
      done
      ;;
    peers-build)
      # llama.cpp built for CUDA (gpu/llama-src.tar.xz: llama-cpp-python 0.3.36's vendor/llama.cpp,
      # pruned as ../shared/anchors/decoder-h100.md says) in the background: it builds while the
      # next calls run (keep each call's gap under the machine's 30 s idle release).
      mkdir -p /tmp/llama
      [ -d /tmp/llama/llama.cpp ] || xz -dc gpu/llama-src.tar.xz | tar x -C /tmp/llama
      (cd /tmp/llama/llama.cpp && setsid nohup bash -c "cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        && cmake --build build -j ${JOBS:-12} --target llama-bench llama-batched-bench; echo rc=\$?" \
        > /tmp/llama/build.log 2>&1 < /dev/null &)
      echo "llama.cpp build started"
      ;;
    peers)
      # kvplan beside llama.cpp (CUDA, the same Q4_1 GGUF) in one call: llama-bench's tg128 (batch 1)
      # and llama-batched-bench's S_TG (batches 1, 8, 32; 32-token prompts), then kvplan's
      # tokens/s at BATCHES (128 new tokens on benches/prompts.txt, after warm-up), spec off and
      # n-gram k=10. Waits for `peers-build` (PEERS_WAIT seconds at most).
      for _ in $(seq $((${PEERS_WAIT:-300} / 5))); do grep -q '^rc=' /tmp/llama/build.log 2>/dev/null && break; sleep 5; done
      tail -2 /tmp/llama/build.log
      bin=/tmp/llama/llama.cpp/build/bin
      "$bin/llama-bench" -m "$MODEL" -p 0 -n 128 -ngl 99 -r 5 2>"$OUT/llama-bench.err" | tee "$OUT/llama-bench.txt"
      "$bin/llama-batched-bench" -m "$MODEL" -c 16384 -b 2048 -ub 512 -npp 32 -ntg 128 -npl 1,8,32 -ngl 99 \
        > "$OUT/llama-batched.txt" 2>&1
      grep -E "^\|" "$OUT/llama-batched.txt"
      [ -f cubecl.toml ] || printf '[compilation]\ncache = true\n' > cubecl.toml
      for bs in ${BATCHES:-1 8 32}; do
        limit=$bs; [ "$bs" = 1 ] && limit=4
        for spec in ${SPECS:-off ngram}; do
          log="$OUT/peers-kvplan-$spec-$bs"
          timeout "${RUN_TIMEOUT:-0}" "$BIN" generate --backend cuda --spec "$spec" --draft-tokens 10 --batch "$bs" --limit "$limit" \
            --max-new-tokens 128 --ignore-eos --json --file benches/prompts.txt > "$log.jsonl" 2> "$log.err"
          echo "kvplan,$spec,$bs,$(grep -h '^generate: [0-9]* requests' "$log.err" | cut -c1-150)"
          if grep -q '^graphs:' "$log.err"; then echo "ERROR: kvplan,$spec,$bs: a capture fell back"; fi
        done
      done
      ;;
    peers-hf)
      # transformers with a static cache and generate's compile (CUDA graphs), f32, on the same
      # GGUF and prompts (carry gpu/whl: the gguf wheel).
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site gpu/whl/*.whl
      PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benches/hf_graphs.py /tmp/kvplan-bin SmolLM2-135M-Instruct.Q4_1.gguf 128 \
        2>"$OUT/hf-graphs.err" | tee "$OUT/hf-graphs.csv"
      tail -4 "$OUT/hf-graphs.err"
      ;;
    peers-gputime)
      # llama.cpp's batch-1 decode kernel by kernel (Nsight Compute, each graph node's duration, clocks
      # and caches as they run): what its attention takes of a token's GPU time, beside kvplan's
      # `gputime`. LLAMA_SKIP launches (the load, the warm-up, the first tokens) skipped, LLAMA_COUNT
      # profiled.
      bin=/tmp/llama/llama.cpp/build/bin
      ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum \
        --launch-skip "${LLAMA_SKIP:-4000}" --launch-count "${LLAMA_COUNT:-1500}" -o "$OUT/ncu-llama" -f \
        "$bin/llama-bench" -m "$MODEL" -p 0 -n 32 -ngl 99 -r 1 > "$OUT/ncu-llama.out" 2>&1
      ncu -i "$OUT/ncu-llama.ncu-rep" --page raw --csv --metrics gpu__time_duration.sum > "$OUT/ncu-llama.csv" 2>&1
      python3 benches/ncu_kernels.py "$OUT/ncu-llama.csv"
      ;;
    decode-prompts)
      # N-gram (k = K, 10 by default) against spec off prompt by prompt at batch 1 (graphs on):
      # each request's decode time (first token to last, `decode_ms`), 128 new tokens, after warm-up.
      [ -f cubecl.toml ] || printf '[compilation]\ncache = true\n' > cubecl.toml
      for spec in off ngram; do
        timeout "${RUN_TIMEOUT:-0}" "$BIN" generate --backend cuda --spec "$spec" --draft-tokens "${K:-10}" --batch 1 --limit 4 \
          --max-new-tokens 128 --ignore-eos --json --file benches/prompts.txt > "$OUT/prompts-$spec.jsonl" 2> "$OUT/prompts-$spec.err"
        echo "$spec: $(grep -h '^generate: [0-9]* requests' "$OUT/prompts-$spec.err" | cut -c1-110)"
      done
      python3 - "$OUT/prompts-off.jsonl" "$OUT/prompts-ngram.jsonl" <<'PY'
import json, sys
off, ngram = ([json.loads(l) for l in open(f)] for f in sys.argv[1:3])
for a, b in zip(off, ngram):
    print(f"{a['prompt'][:32]:32} off {a['decode_ms']:7.1f} ms, n-gram {b['decode_ms']:7.1f} ms "
          f"({b['steps']} steps, {b['accepted']}/{b['drafted']} kept): {a['decode_ms'] / b['decode_ms']:.2f}x, "
          f"tokens {'equal' if a['tokens'] == b['tokens'] else 'DIFFERENT'}")
PY
      ;;
    decode|decode-ab)
      # Tokens/s, 128 new tokens, batch 1 (4 prompts one at a time), 8 and 32; spec off, n-gram
      # (k = 4 and 10: transformers' prompt lookup drafts 10), self (26 blocks, k = 4, stopping
      # under 0.4; self0: never stopping, as transformers' early exit; self14: 14 blocks).
      # BATCHES and SPECS pick rows. decode-ab runs both builds for each row, the baseline first in
      # every other row (the host drifts between runs: an order kept for every row biases it).
      # CubeCL keeps compiled kernels between the runs (its autotune results it keeps by default).
      [ -f cubecl.toml ] || printf '[compilation]\ncache = true\n' > cubecl.toml
      builds=new; [ "$part" = decode-ab ] && builds="old new"
      for bs in ${BATCHES:-1 8 32}; do
        limit=$bs; [ "$bs" = 1 ] && limit=4
        for spec in ${SPECS:-off ngram ngram10 self}; do
          k=4; mode=$spec; extra=()
          case "$spec" in
            ngram10) k=10; mode=ngram ;;
            self0) mode=self; extra=(--draft-confidence 0) ;;
            self14) mode=self; extra=(--draft-layers 14) ;;
          esac
          order=$builds; pairs=$((${pairs:-0} + 1)); [ $((pairs % 2)) = 0 ] && [ "$builds" != new ] && order="new old"
          for build in $order; do
            bin="$BIN"; tag=kvplan; [ "$build" = old ] && bin="$BINOLD" && tag=kvplan-old
            log="$OUT/decode-$build-$spec-$bs"
            # NEW_ARGS: flags for this build only (--graphs off: the eager steps).
            args=("${extra[@]}"); [ "$build" = new ] && args+=(${NEW_ARGS:-})
            "$bin" generate --backend cuda --spec "$mode" --draft-tokens "$k" "${args[@]}" --batch "$bs" --limit "$limit" --max-new-tokens 128 \
              --ignore-eos --json --file benches/prompts.txt > "$log.jsonl" 2> "$log.err"
            echo "$tag,$spec,$bs,$(grep -h '^generate: [0-9]* requests' "$log.err")"
            grep -h '^generate: warm-up\|^generate: step' "$log.err"
            # A capture that fell back (its replays run the step again) is an error in a benchmark.
            if grep -q '^graphs:' "$log.err"; then echo "ERROR: $tag,$spec,$bs: a capture fell back"; fi
          done
        done
      done
      ;;
    profile-ab)
      # Where an eager n-gram step's time goes on both builds (issue 42's gate: n-gram against
      # a737faa): each step phase's host enqueue and device wait (--profile), graphs off.
      for bs in ${BATCHES:-32}; do
        for build in old new; do
          bin="$BIN"; args=(--graphs off); [ "$build" = old ] && bin="$BINOLD" && args=()
          "$bin" generate --backend cuda --spec ngram --draft-tokens 10 "${args[@]}" --batch "$bs" --limit "$bs" \
            --max-new-tokens 128 --ignore-eos --profile --file benches/prompts.txt > /dev/null 2> "$OUT/profile-ab-$build-$bs.err"
          echo "== $build, n-gram k=10, batch $bs"; grep -E "^(generate: [0-9]|profile:)" "$OUT/profile-ab-$build-$bs.err" | cut -c1-160
        done
      done
      ;;
    repeat|repeat-ab)
      # What kvplan's stores and attention cost a pipelined step: each layer's attend runs twice on
      # every other step (--repeat-ops); the difference of the two medians, spec off. repeat-ab
      # runs both builds for each row, the baseline first in every other row.
      [ -f cubecl.toml ] || printf '[compilation]\ncache = true\n' > cubecl.toml
      builds=new; [ "$part" = repeat-ab ] && builds="old new"
      for bs in ${BATCHES:-1 8 32}; do
        limit=$bs; [ "$bs" = 1 ] && limit=4
        for kind in ${KINDS:-attention}; do
          order=$builds; pairs=$((${pairs:-0} + 1)); [ $((pairs % 2)) = 0 ] && [ "$builds" != new ] && order="new old"
          for build in $order; do
            bin="$BIN"; tag=kvplan; [ "$build" = old ] && bin="$BINOLD" && tag=kvplan-old
            log="$OUT/repeat-$build-$kind-$bs.err"
            "$bin" generate --backend cuda --spec off --batch "$bs" --limit "$limit" --max-new-tokens 128 \
              --ignore-eos --repeat-ops "$kind" --file benches/prompts.txt > /dev/null 2> "$log"
            echo "$tag,repeat,$bs,$(grep -h '^repeat-ops' "$log")"
            grep -h '^generate: [0-9]* requests' "$log"
          done
        done
      done
      ;;
    profile)
      # Where a decode step's time goes: phases (host enqueue, device wait), then the same run with
      # CubeCL's compile and autotune logs, then its per-sync kernel profile (cubecl.toml in a run dir).
      prompts="$PWD/benches/prompts.txt"
      for run in "off 1 2" "ngram 1 2" "off 8 8"; do
        read -r spec bs limit <<< "$run"
        "$BIN" generate --backend cuda --spec "$spec" --batch "$bs" --limit "$limit" --max-new-tokens 128 \
          --ignore-eos --profile --file "$prompts" > /dev/null 2> "$OUT/profile-$spec-$bs.err"
        echo "== profile spec $spec batch $bs"; grep -E "^(generate|profile):" "$OUT/profile-$spec-$bs.err"
      done
      mkdir -p /tmp/kvplan-logs && cd /tmp/kvplan-logs && rm -f ./*.log
      printf '[compilation.logger]\nlevel = "basic"\nfile = "/tmp/kvplan-logs/compile.log"\n[autotune.logger]\nlevel = "minimal"\nfile = "/tmp/kvplan-logs/autotune.log"\n' > cubecl.toml
      "$BIN" generate --backend cuda --spec off --batch 1 --limit 2 --max-new-tokens 128 --ignore-eos --profile \
        --file "$prompts" > /dev/null 2> "$OUT/profile-logged.err"
      echo "== with compile/autotune logs"; grep -E "^profile: step" "$OUT/profile-logged.err"
      echo "compile log lines: $(wc -l < compile.log 2>/dev/null), autotune log lines: $(wc -l < autotune.log 2>/dev/null)"
      head -c 3000 compile.log; echo; head -c 2000 autotune.log; echo
      cut -c1-120 compile.log | sort | uniq -c | sort -rn | head -20
      printf '[profiling.logger]\nlevel = "basic"\nfile = "/tmp/kvplan-logs/profile.log"\n' > cubecl.toml
      "$BIN" generate --backend cuda --spec off --batch 1 --limit 1 --max-new-tokens 40 --ignore-eos \
        --file "$prompts" > /dev/null 2> "$OUT/profile-kernels.err"
      echo "kernel profile: $(wc -l < profile.log) lines"; tail -c 6000 profile.log
      cp compile.log autotune.log profile.log "$OUT/" 2>/dev/null; cd - > /dev/null
      ;;
    gputime)
      # The kernels' GPU time a decode step (CUPTI), in all and kernel by kernel: the ceiling a
      # replayed step reaches (issue 43, part 1).
      prompts="$PWD/benches/prompts.txt"
      for bs in ${BATCHES:-1 8 32}; do
        for spec in ${SPECS:-off ngram}; do
          KVPLAN_GPU_TIME=1 "$BIN" generate --backend cuda --spec "$spec" --batch "$bs" --limit "$bs" \
            --max-new-tokens 128 --ignore-eos --file "$prompts" > /dev/null 2> "$OUT/gputime-$spec-$bs.err"
          echo "== gpu time spec $spec batch $bs"
          grep -E "^generate: [0-9]* requests|^gpu-time" "$OUT/gputime-$spec-$bs.err"
          grep -E "^gpu-kernel" "$OUT/gputime-$spec-$bs.err" | head -${KERNELS:-12}
        done
      done
      ;;
    ncu-decode)
      # Where a decode step's kernels spend their time (Nsight Compute, graphs off, after the
      # prefill): each launch's duration, occupancy and warp stalls, then the attention's SASS with
      # its stall samples, and the kernels' generated source (CubeCL's full compile log).
      for bs in ${BATCHES:-1 8}; do
        rep="$OUT/ncu-decode-$bs"
        KVPLAN_NO_CUPTI=1 ncu --clock-control none --section SpeedOfLight --section LaunchStats \
          --section Occupancy --section WarpStateStats --section InstructionStats --section SourceCounters \
          --section MemoryWorkloadAnalysis \
          -k regex:"${NCU_KERNELS:-store_attention|attention_combine|linear_block}" --launch-skip "${NCU_SKIP:-900}" \
          --launch-count "${NCU_COUNT:-6}" -o "$rep" -f "$BIN" generate --backend cuda --no-warm-up --graphs off \
          --spec off --batch "$bs" --limit "$bs" --max-new-tokens 24 --ignore-eos --file benches/prompts.txt \
          > "$rep.out" 2>&1
        ncu -i "$rep.ncu-rep" --page raw --csv > "$rep-raw.csv" 2>&1
        ncu -i "$rep.ncu-rep" --page details > "$rep.txt" 2>&1
        echo "== ncu batch $bs"
        python3 - "$rep-raw.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head = rows[0]
want = ["Kernel Name", "gpu__time_duration.sum", "launch__grid_size", "launch__registers_per_thread",
        "smsp__inst_executed.sum", "sm__warps_active.avg.pct_of_peak_sustained_active",
        "l1tex__t_sector_hit_rate.pct", "lts__t_sector_hit_rate.pct",
        "l1tex__throughput.avg.pct_of_peak_sustained_active", "lts__throughput.avg.pct_of_peak_sustained_elapsed",
        "dram__throughput.avg.pct_of_peak_sustained_elapsed"]
for r in rows[2:]:
    d = dict(zip(head, r))
    stalls = sorted(((float(v.replace(",", "")), k.split("issue_stalled_")[1].split("_per")[0])
                     for k, v in d.items() if "average_warps_issue_stalled" in k and "per_issue_active" in k
                     and v.replace(",", "").replace(".", "").isdigit()), reverse=True)[:5]
    print(" | ".join(d.get(k, "?")[:40] for k in want), "|", ", ".join(f"{n} {v:.1f}" for v, n in stalls))
PY
      done
      ncu -i "$OUT/ncu-decode-1.ncu-rep" -k regex:store_attention --page source --csv --print-source sass \
        > "$OUT/ncu-attention-sass.csv" 2>&1
      ncu -i "$OUT/ncu-decode-1.ncu-rep" -k regex:linear_block --page source --csv --print-source sass \
        > "$OUT/ncu-linear-sass.csv" 2>&1
      wc -l "$OUT"/ncu-*-sass.csv
      mkdir -p /tmp/kvplan-logs && (cd /tmp/kvplan-logs && rm -f ./*.log &&
        printf '[compilation.logger]\nlevel = "full"\nfile = "/tmp/kvplan-logs/compile.log"\n' > cubecl.toml &&
        "$BIN" generate --backend cuda --no-warm-up --graphs off --spec off --max-new-tokens 4 \
          "What is the capital of France?" > /dev/null 2>&1;
        xz -6 -c compile.log > "$OUT/compile-full.log.xz"; ls -la compile.log)
      ;;
    anchor)
      # transformers on the same GGUF and prompts (carry .whl with the gguf wheel).
      PYTHONUNBUFFERED=1 python3 benches/hf_anchor.py /tmp/kvplan-bin SmolLM2-135M-Instruct.Q4_1.gguf 128 2>"$OUT/anchor.err" | tee "$OUT/anchor.csv"
      tail -3 "$OUT/anchor.err"
      ;;
    plan|gather)
      "$BIN" bench "$part" --backend cuda --reps 50 2>&1 | tee "$OUT/bench-$part.txt"
      ;;
    host)
      # Each op's host cost against a plain Burn launch, without CUPTI (its callbacks cost host time).
      for backend in cuda cuda-unfused; do
        echo "== host $backend"
        KVPLAN_NO_CUPTI=1 "$BIN" bench host --backend "$backend" --reps 400 2>&1 | tee "$OUT/bench-host-$backend.txt"
      done
      ;;
    extension)
      # What a backend extension op costs before kvplan's work (probe ops beside a plain launch),
      # fused and unfused, alternating (HOST_ROUNDS, default 2).
      for round in $(seq "${HOST_ROUNDS:-2}"); do
        for backend in cuda cuda-unfused; do
          echo "== extension $backend round $round"
          KVPLAN_NO_CUPTI=1 "$BIN" bench extension --backend "$backend" --reps 400 2>&1 | tee "$OUT/bench-extension-$backend-$round.txt"
        done
      done
      ;;
    host-ab)
      # The host bench of the baseline build and this one, alternating (HOST_ROUNDS, default 2).
      for round in $(seq "${HOST_ROUNDS:-2}"); do
        for build in old new; do
          bin="$BIN"; [ "$build" = old ] && bin="$BINOLD"
          echo "== host $build round $round"
          KVPLAN_NO_CUPTI=1 "$bin" bench host --backend cuda --reps 400 2>&1 | tee "$OUT/bench-host-$build-$round.txt"
        done
      done
      ;;
    ab)
      # Burn 0.21 (099ad25) against this build on the kernel grids, GPU time through CUPTI;
      # two rounds each, alternating, so that clocks and the machine's state hit both alike.
      for round in $(seq "${AB_ROUNDS:-2}"); do
        for which in gather plan canary; do
          "$BIN021" bench "$which" --backend cuda --reps 50 > "$OUT/ab-$which-021-$round.txt" 2>&1
          "$BIN" bench "$which" --backend cuda --reps 50 > "$OUT/ab-$which-022-$round.txt" 2>&1
          echo "ab $which round $round: rc done"
        done
      done
      python3 benches/ab.py "$OUT" | tee "$OUT/ab.md"
      ;;
  esac
done
