// The chain fold with mix computed on 32-bit halves (benches/RESULTS.md, session 11). Build and run:
//   nvcc -O3 -arch=sm_90 -o chain_halves benches/chain_halves.cu && ./chain_halves
#include <cstdio>
#include <cuda_runtime.h>
#include "chain_mix.cuh"
typedef unsigned u32;
// 32-bit halves; multiply as lo*Cl, umulhi + two low products
template <int V>
__device__ __forceinline__ void mulc(u32& lo, u32& hi, u32 cl, u32 ch) {
  if (V == 0) { u32 nl = lo * cl; u32 nh = __umulhi(lo, cl) + lo * ch + hi * cl; lo = nl; hi = nh; }
  if (V == 1) { u32 nl = lo * cl; u32 a = lo * ch; u32 b = hi * cl; u32 c = __umulhi(lo, cl); u32 nh; asm("add.u32 %0, %1, %2;" : "=r"(nh) : "r"(a), "r"(b)); nh += c; lo = nl; hi = nh; }
  if (V == 2) { u64 w = (u64)lo * cl; u32 s = lo * ch + hi * cl; lo = (u32)w; hi = (u32)(w >> 32) + s; }
}
__device__ __forceinline__ void xs(u32& lo, u32& hi, int s) {
  u32 nl = lo ^ ((lo >> s) | (hi << (32 - s))); u32 nh = hi ^ (hi >> s); lo = nl; hi = nh;
}
template <int V>
__device__ __forceinline__ void mix32(u32& lo, u32& hi) {
  xs(lo, hi, 30); mulc<V>(lo, hi, 0x1CE4E5B9u, 0xBF58476Du);
  xs(lo, hi, 27); mulc<V>(lo, hi, 0x133111EBu, 0x94D049BBu);
  xs(lo, hi, 31);
}
__global__ void k_vec(u64* out, int n) {
  u64 h = 0xDE7FAE23A9A1B716ull ^ threadIdx.x;
  #pragma unroll 8
  for (int i = 0; i < n; ++i) h = mix3(h, 7, (u64)i);
  out[threadIdx.x] = h;
}
template <int V>
__global__ void k_32(u64* out, int n) {
  u32 lo = 0xA9A1B716u ^ threadIdx.x, hi = 0xDE7FAE23u;
  #pragma unroll 8
  for (int i = 0; i < n; ++i) { mix32<V>(lo, hi); lo ^= 7; mix32<V>(lo, hi); lo ^= (u32)i; mix32<V>(lo, hi); }
  out[threadIdx.x] = ((u64)hi << 32) | lo;
}
int main() {
  const int n = 32768; u64* out; cudaMalloc(&out, 4096);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  const char* names[] = {"vector u64", "u32 umulhi", "u32 umulhi asm add", "u32 wide+sum"};
  u64 res[4];
  for (int v = 0; v < 4; ++v) {
    float best = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
      float ms; cudaEventRecord(a);
      if (v == 0) k_vec<<<1, 32>>>(out, n);
      if (v == 1) k_32<0><<<1, 32>>>(out, n);
      if (v == 2) k_32<1><<<1, 32>>>(out, n);
      if (v == 3) k_32<2><<<1, 32>>>(out, n);
      cudaEventRecord(b); cudaEventSynchronize(b); cudaEventElapsedTime(&ms, a, b);
      best = ms < best ? ms : best;
    }
    cudaMemcpy(&res[v], out, 8, cudaMemcpyDeviceToHost);
    printf("%-24s %.3f ms  %.1f ns/token  h=%016llx\n", names[v], best, best * 1e6 / n, res[v]);
  }
  return 0;
}
