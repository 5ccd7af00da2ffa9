// Latency floor of the kv-canary chain fold h = mix3(h, token, position) on one warp of an H200,
// and what a tile walk adds to it (benches/RESULTS.md, session 3). Build and run on the GPU:
//   nvcc -O3 -arch=sm_90 -o chain_floor benches/chain_floor.cu && ./chain_floor
#include <cstdio>
#include <cuda_runtime.h>
#include "chain_mix.cuh"

// A: vector registers, no loads.
__global__ void vec_only(u64* out, int n) {
  u64 h = 0xDE7FAE23A9A1B716ull ^ threadIdx.x;
  #pragma unroll 8
  for (int i = 0; i < n; ++i) h = mix3(h, 7, (u64)i);
  out[threadIdx.x] = h;
}
// The tile walks: tiles of 32, each lane loads its own entry, the warp folds the tile and each
// lane keeps the chain value of its entry, then stores that entry's record. The tile's values
// reach the fold by a broadcast load per entry (lavapipe's path) or by shuffles; with `Prefetch`
// the lanes load the next tile's entries before folding this one (CUDA's path).
template <bool Shuffle, bool Prefetch>
__global__ void tiles(const u64* slot, const u64* tok, const u64* pos, u64* buf, int n) {
  unsigned lane = threadIdx.x;
  u64 h = 0xDE7FAE23A9A1B716ull;
  u64 ns = slot[lane], nt = tok[lane], np = pos[lane];
  for (int t = 0; t < n; t += 32) {
    if (!Prefetch) { ns = slot[t + lane]; nt = tok[t + lane]; np = pos[t + lane]; }
    u64 os = ns, ot = nt, op = np, oc = 0;
    if (Prefetch && t + 32 < n) { ns = slot[t + 32 + lane]; nt = tok[t + 32 + lane]; np = pos[t + 32 + lane]; }
    #pragma unroll
    for (unsigned j = 0; j < 32; ++j) {
      u64 s = Shuffle ? __shfl_sync(~0u, os, j) : slot[t + j];
      u64 k = Shuffle ? __shfl_sync(~0u, ot, j) : tok[t + j];
      u64 p = Shuffle ? __shfl_sync(~0u, op, j) : pos[t + j];
      oc = j == lane ? h : oc;
      u64 m = mix3(h, k, p);
      h = (s >> 63) == 0 ? m : h;
    }
    buf[os * 4] = ot; buf[os * 4 + 1] = op; buf[os * 4 + 2] = oc; buf[os * 4 + 3] = 0;
  }
}
int main() {
  const int n = 32768; u64 *slot, *tok, *pos, *buf, *out;
  cudaMalloc(&slot, n * 8); cudaMalloc(&tok, n * 8); cudaMalloc(&pos, n * 8);
  cudaMalloc(&buf, 2 * n * 32); cudaMalloc(&out, 256);
  u64* h = new u64[n];
  for (int i = 0; i < n; ++i) h[i] = (u64)((i * 7919u) % (2 * n));
  cudaMemcpy(slot, h, n * 8, cudaMemcpyHostToDevice);
  for (int i = 0; i < n; ++i) h[i] = i;
  cudaMemcpy(tok, h, n * 8, cudaMemcpyHostToDevice); cudaMemcpy(pos, h, n * 8, cudaMemcpyHostToDevice);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int v = 0; v < 4; ++v) {
    float best = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
      float ms;
      cudaEventRecord(a);
      if (v == 0) vec_only<<<1, 32>>>(out, n);
      if (v == 1) tiles<false, false><<<1, 32>>>(slot, tok, pos, buf, n);
      if (v == 2) tiles<true, false><<<1, 32>>>(slot, tok, pos, buf, n);
      if (v == 3) tiles<true, true><<<1, 32>>>(slot, tok, pos, buf, n);
      cudaEventRecord(b); cudaEventSynchronize(b); cudaEventElapsedTime(&ms, a, b);
      best = ms < best ? ms : best;
    }
    const char* names[] = {"vector chain only", "tiles, broadcast loads", "tiles, shuffles", "tiles, shuffles, prefetch"};
    printf("%-28s %.3f ms  %.1f ns/token\n", names[v], best, best * 1e6 / n);
  }
  return 0;
}
