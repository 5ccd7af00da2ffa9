#!/usr/bin/env bash
# The test command (README, CI): installs Mesa's software Vulkan device when it is missing, then runs
# every test with the Vulkan requirement on, so that the real kernels run on the CPU (lavapipe).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! ldconfig -p | grep -q 'libvulkan.so.1' || ! ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1; then
    echo "installing Mesa's software Vulkan device (mesa-vulkan-drivers, libvulkan1)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mesa-vulkan-drivers libvulkan1 >/dev/null
fi

# Tests that need a Vulkan adapter fail (never skip) when it is missing.
export KVPLAN_REQUIRE_VULKAN=1
# lavapipe wants a runtime dir; without one it only prints a warning.
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
cargo test --release --workspace "$@"
# The attention with a cube for each K/V head's query heads in every launch
# (`KVPLAN_ATTENTION_GROUPED=1`; by default only past 16 tokens): the same tests, the same bits.
KVPLAN_ATTENTION_GROUPED=1 cargo test --release --workspace "$@" --test kvplan -- attention paged
# And no launch staging its K rows in shared memory (`KVPLAN_ATTENTION_STAGED=0`; by default up to
# 16 tokens): the same tests, the same bits.
KVPLAN_ATTENTION_STAGED=0 cargo test --release --workspace "$@" --test kvplan -- attention paged
# The projection's other layouts, candidates on a GPU (`decoder/src/linear/mod.rs`'s knobs): 3
# rounds of loads together where a block is small (a part's rounds in batches of 3 and fewer),
# then 4 columns a plane at every count; a token's bits the same in each.
KVPLAN_PROJECTION_BLOCK_AHEAD=3 \
    cargo test --release --workspace "$@" --test kvplan -- decoder_projection
KVPLAN_PROJECTION_BLOCK_COLUMNS=4 \
    cargo test --release --workspace "$@" --test kvplan -- decoder_projection
