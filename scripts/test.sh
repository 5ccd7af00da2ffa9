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
# The projections' other layouts, candidates on a GPU (`decoder/src/linear/mod.rs`'s knobs): the
# block kernel at every token count with 2 columns a plane (blocks of 1 to 32 tokens, a token's
# bits the same in each), then staged inputs with 4.
KVPLAN_PROJECTION_STEP_TOKENS=0 KVPLAN_PROJECTION_BLOCK_COLUMNS=2 \
    cargo test --release --workspace "$@" --test kvplan -- decoder_projection
KVPLAN_PROJECTION_STAGE_INPUTS=1 KVPLAN_PROJECTION_BLOCK_COLUMNS=4 \
    cargo test --release --workspace "$@" --test kvplan -- decoder_projection
