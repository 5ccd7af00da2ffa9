#!/usr/bin/env bash
# LLVM 23 for a CUDA build (cubecl-cuda 0.11 links it in), offline: tracel-llvm-bundler downloads
# it unless a marked install is already in its folder, so put PyPI's mlc-llvm-static there.
# With internet nothing of this is needed: the bundler downloads LLVM by itself.
set -euo pipefail
# The bundler's version in Cargo.lock (tracel-llvm-bundler 23.1.0-4): its folder is keyed on it.
BUNDLER=23.1.0-4
if ! python3 -c 'import mlc_llvm_static' 2>/dev/null; then
    python3 -m pip install -q 'mlc-llvm-static[all]==23.1.1.post0' ||
        python3 -m pip install -q --break-system-packages 'mlc-llvm-static[all]==23.1.1.post0'
fi
prefix=$(python3 -m mlc_llvm_static.config --prefix)
dir="${XDG_DATA_HOME:-$HOME/.local/share}/tracel"
mkdir -p "$dir"
# Only when missing: the bundler's build script reruns on their timestamps, and with it every
# crate above cubecl-cuda (a full Burn rebuild).
[ "$(readlink "$dir/tracel-llvm-$BUNDLER")" = "$prefix" ] || ln -sfn "$prefix" "$dir/tracel-llvm-$BUNDLER"
[ -f "$prefix/.tracel-llvm-installed" ] || touch "$prefix/.tracel-llvm-installed"
echo "LLVM for tracel-llvm-bundler $BUNDLER: $dir/tracel-llvm-$BUNDLER -> $prefix"
