//! The kv-canary hash constants and device hash functions (spec `canary-write-verify.md` §3, §5).
//!
//! The host reference folds with the same constants (`kvplan::reference::canary`); the two are
//! pinned to each other by the conformance vectors.

use cubecl::prelude::*;

/// `CANARY_CHAIN_ANCHOR`: the chain value a request without a seed starts from (before mixing).
pub const CHAIN_ANCHOR: u64 = 0xC0FF_EE12_3456_7890;
/// First splitmix64 multiplier.
pub const MIX_MUL_1: u64 = 0xBF58_476D_1CE4_E5B9;
/// Second splitmix64 multiplier.
pub const MIX_MUL_2: u64 = 0x94D0_49BB_1331_11EB;

/// `mix(x)`: the splitmix64 finalizer without its additive step.
#[cube]
pub fn mix(x: u64) -> u64 {
    let x = (x ^ (x >> 30)) * MIX_MUL_1;
    let x = (x ^ (x >> 27)) * MIX_MUL_2;
    x ^ (x >> 31)
}

/// `mix3(a, b, c) = mix(mix(mix(a) ^ b) ^ c)`: one chain link.
#[cube]
pub fn mix3(a: u64, b: u64, c: u64) -> u64 {
    mix(mix(mix(a) ^ b) ^ c)
}
