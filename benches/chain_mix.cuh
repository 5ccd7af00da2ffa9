// The kv-canary hash for the chain probes (`chain_floor.cu`, `chain_uniform.cu`,
// `chain_halves.cu`): spec `canary-write-verify.md` §5, as `kernels/src/hash.rs` computes it.
#pragma once
typedef unsigned long long u64;
__device__ __forceinline__ u64 mix(u64 x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
__device__ __forceinline__ u64 mix3(u64 h, u64 t, u64 p) { return mix(mix(mix(h) ^ t) ^ p); }
