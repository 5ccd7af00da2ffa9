// Does the kv-canary chain reach the H200's uniform datapath when its inputs come from memory?
// (benches/RESULTS.md, session 11). Build and run on the GPU:
//   nvcc -O3 -arch=sm_90 -o chain_uniform benches/chain_uniform.cu && ./chain_uniform
// then `cuobjdump -sass chain_uniform | grep -c UIMAD` per function.
#include <cstdio>
#include <cuda_runtime.h>
#include "chain_mix.cuh"

__global__ void k_vec(const u64* tok, const u64* pos, u64* out, int n) {
  u64 h = 0xDE7FAE23A9A1B716ull ^ threadIdx.x;
  #pragma unroll 8
  for (int i = 0; i < n; ++i) h = mix3(h, 7, (u64)i);
  out[threadIdx.x] = h;
}
__global__ void k_const(const u64* tok, const u64* pos, u64* out, int n) {
  u64 h = 0xDE7FAE23A9A1B716ull;
  #pragma unroll 8
  for (int i = 0; i < n; ++i) h = mix3(h, 7, (u64)i);
  out[threadIdx.x] = h;
}
// uniform-address global loads
__global__ void k_uload(const u64* tok, const u64* pos, u64* out, int n) {
  u64 h = out[40];
  #pragma unroll 8
  for (int i = 0; i < n; ++i) h = mix3(h, tok[i], pos[i]);
  out[threadIdx.x] = h;
}
// tiles, shuffles, prefetch; h uniform from memory
template <int Stage>
__global__ void k_tiles(const u64* slot, const u64* tok, const u64* pos, u64* buf, int n, u64* out) {
  __shared__ u64 ss[32], st[32], sp[32];
  unsigned lane = threadIdx.x;
  u64 h = out[40];
  u64 ns = slot[lane], nt = tok[lane], np = pos[lane];
  for (int t = 0; t < n; t += 32) {
    u64 os = ns, ot = nt, op = np, oc = 0;
    if (t + 32 < n) { ns = slot[t + 32 + lane]; nt = tok[t + 32 + lane]; np = pos[t + 32 + lane]; }
    if (Stage == 1) { __syncwarp(); ss[lane] = os; st[lane] = ot; sp[lane] = op; __syncwarp(); }
    #pragma unroll
    for (unsigned j = 0; j < 32; ++j) {
      u64 s, k, p;
      if (Stage == 1) { s = ss[j]; k = st[j]; p = sp[j]; }
      else { s = __shfl_sync(~0u, os, j); k = __shfl_sync(~0u, ot, j); p = __shfl_sync(~0u, op, j); }
      oc = j == lane ? h : oc;
      u64 m = mix3(h, k, p);
      h = (s >> 63) == 0 ? m : h;
    }
    buf[os * 4] = ot; buf[os * 4 + 1] = op; buf[os * 4 + 2] = oc; buf[os * 4 + 3] = 0;
  }
  if (lane == 0) out[41] = h;
}
int main() {
  const int n = 32768; u64 *slot, *tok, *pos, *buf, *out;
  cudaMalloc(&slot, n * 8); cudaMalloc(&tok, n * 8); cudaMalloc(&pos, n * 8);
  cudaMalloc(&buf, 2 * n * 32); cudaMalloc(&out, 512);
  cudaMemset(out, 0, 512);
  u64* h = new u64[n];
  for (int i = 0; i < n; ++i) h[i] = (u64)((i * 7919u) % (2 * n));
  cudaMemcpy(slot, h, n * 8, cudaMemcpyHostToDevice);
  for (int i = 0; i < n; ++i) h[i] = i;
  cudaMemcpy(tok, h, n * 8, cudaMemcpyHostToDevice); cudaMemcpy(pos, h, n * 8, cudaMemcpyHostToDevice);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  const char* names[] = {"vector", "const uniform", "uniform global loads", "tiles shfl prefetch, h from mem", "tiles smem stage"};
  for (int v = 0; v < 5; ++v) {
    float best = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
      float ms;
      cudaEventRecord(a);
      if (v == 0) k_vec<<<1, 32>>>(tok, pos, out, n);
      if (v == 1) k_const<<<1, 32>>>(tok, pos, out, n);
      if (v == 2) k_uload<<<1, 32>>>(tok, pos, out, n);
      if (v == 3) k_tiles<0><<<1, 32>>>(slot, tok, pos, buf, n, out);
      if (v == 4) k_tiles<1><<<1, 32>>>(slot, tok, pos, buf, n, out);
      cudaEventRecord(b); cudaEventSynchronize(b); cudaEventElapsedTime(&ms, a, b);
      best = ms < best ? ms : best;
    }
    printf("%-34s %.3f ms  %.1f ns/token\n", names[v], best, best * 1e6 / n);
  }
  return 0;
}
