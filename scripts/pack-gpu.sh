#!/usr/bin/env bash
# Builds the CUDA binaries and packs them into gpu/ (ignored) for `device`: the `kvplan` tool and
# the integration-test binary, each stripped and xz-compressed (with LLVM linked in, two of them do
# not fit one call's 64 MiB). Carry ["gpu/tests.xz"] in one call with `scripts/gpu.sh stage`, then
# ["gpu"] (without tests.xz) in the next, while the machine is warm: `scripts/gpu.sh tests checks ...`.
# `scripts/pack-gpu.sh ab` also builds the Burn 0.21 binary of the last pre-port main (099ad25)
# into gpu/bin021.xz, for `scripts/gpu.sh ab`.
# `scripts/pack-gpu.sh model` also splits the model into gpu/model.part-* (one part per call);
# `model-xz` compresses it into gpu/mx.part-aa (carried with a binary) and gpu/mx.part-ab.
# `scripts/pack-gpu.sh peers` also packs llama.cpp's sources and the gguf wheel (`scripts/gpu.sh
# peers-build peers peers-hf`).
# `scripts/pack-gpu.sh old REV` also builds REV's `kvplan` into gpu/binold.xz (a worktree sharing
# target-cuda, so only the workspace's own crates build again), for `scripts/gpu.sh decode-ab`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/cuda-toolchain.sh
export CARGO_TARGET_DIR="$PWD/target-cuda"
mkdir -p gpu
# One build for both: the test binary's features are the binary's. No wgpu: the GPU machine
# runs CUDA only.
features=(--no-default-features --features cuda)
cargo build --release -p kvplan-tools "${features[@]}" --bin kvplan
tests=$(cargo test --release -p kvplan-tools "${features[@]}" --test kvplan --no-run 2>&1 |
    tee /dev/stderr | sed -n 's/.*Executable.*(\(.*\))/\1/p')
strip -o gpu/kvplan target-cuda/release/kvplan
strip -o gpu/kvplan-tests "$tests"
xz -9 -T2 -f gpu/kvplan gpu/kvplan-tests
mv gpu/kvplan-tests.xz gpu/tests.xz
mv gpu/kvplan.xz gpu/bin.xz
while [ $# -gt 0 ]; do
    extra=$1
    shift
    case "$extra" in
        old)
            rev=$1
            shift
            tree=target-cuda/old-src
            git worktree remove --force "$tree" 2>/dev/null || true
            git worktree add --detach "$tree" "$rev"
            (cd "$tree" && cargo build --release -p kvplan-tools "${features[@]}" --bin kvplan)
            strip -o gpu/kvplan-old target-cuda/release/kvplan
            git worktree remove --force "$tree"
            # The worktree's crates hash like this tree's (same relative paths), so their artifacts
            # would pass for this tree's in a later build (one that finds the worktree's sources
            # unchanged): clean them, then build this tree's binary again.
            cargo clean --release -p kvplan -p kvplan-kernels -p kvplan-decoder -p kvplan-tools
            cargo build --release -p kvplan-tools "${features[@]}" --bin kvplan
            xz -9 -T2 -f gpu/kvplan-old
            mv gpu/kvplan-old.xz gpu/binold.xz
            ;;
        ab)
            # Burn 0.21 needs no LLVM (cudarc loads NVRTC at run time).
            tree=target-021/src
            [ -d "$tree" ] || git worktree add --detach "$tree" 099ad25
            (cd "$tree" && CARGO_TARGET_DIR="$PWD/../build" cargo build --release \
                --no-default-features --features cuda --bin kvplan)
            strip -o gpu/kvplan-021 target-021/build/release/kvplan
            xz -9 -T2 -f gpu/kvplan-021
            mv gpu/kvplan-021.xz gpu/bin021.xz
            ;;
        model)
            model=$(bash scripts/fetch-model.sh | tail -1)
            split -n 2 -a 2 "$model" gpu/model.part-
            ;;
        model-xz)
            # Compressed, in a 30 MB part that travels with a packed binary (and the ~5.7 MB
            # tree: 64 MiB a call) and the rest, which travels alone: a fresh machine runs the
            # binary in the second call.
            model=$(bash scripts/fetch-model.sh | tail -1)
            xz -T2 -6 -c "$model" > gpu/model.xz
            head -c 30000000 gpu/model.xz > gpu/mx.part-aa
            tail -c +30000001 gpu/model.xz > gpu/mx.part-ab
            rm gpu/model.xz
            ;;
        peers)
            # The peers' sources for `scripts/gpu.sh peers-build peers peers-hf`: llama.cpp as
            # llama-cpp-python 0.3.36 vendors it, pruned to what its CUDA build needs (4.5 MB), and
            # the gguf wheel transformers reads the GGUF with.
            work=$(mktemp -d)
            python3 -m pip download -q --no-deps -d gpu/whl gguf==0.19.0
            url=$(curl -s -H "Accept: application/vnd.pypi.simple.v1+json" https://pypi.org/simple/llama-cpp-python/ |
                python3 -c "import json, sys; print(next(f['url'] for f in json.load(sys.stdin)['files'] if f['filename'] == 'llama_cpp_python-0.3.36.tar.gz'))")
            curl -sL "$url" | tar xz -C "$work"
            vendor="$work/llama_cpp_python-0.3.36/vendor"
            (cd "$vendor/llama.cpp" && rm -rf models docs media tools/ui benches tests conversion gguf-py &&
                cd ggml/src && rm -rf ggml-sycl ggml-vulkan ggml-opencl ggml-hexagon ggml-metal ggml-et ggml-cann \
                    ggml-musa ggml-hip ggml-openvino ggml-webgpu ggml-zdnn ggml-zendnn ggml-virtgpu)
            tar cf - -C "$vendor" llama.cpp | xz -9 -T2 > gpu/llama-src.tar.xz
            rm -rf "$work"
            ;;
    esac
done
ls -la gpu/
