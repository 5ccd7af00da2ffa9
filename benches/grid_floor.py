# How much GPU time a grid of cubes costs by itself: a Triton kernel with `n` programs of 8 warps
# that load 256 values, scan them and store one value per lane (the plan skeleton's shape).
import torch, triton, triton.language as tl
from torch.profiler import profile, ProfilerActivity

@triton.jit
def skel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs)
    s = tl.cumsum(v, 0)
    tl.store(y_ptr + pid * BLOCK + offs, s)

@triton.jit
def empty(y_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + pid * BLOCK + offs, offs, mask=offs < 0)

x = torch.ones(256, dtype=torch.int64, device='cuda')
y = torch.empty(4096 * 256, dtype=torch.int64, device='cuda')
for name, k in [("empty", lambda n: empty[(n,)](y, BLOCK=256, num_warps=8)), ("skeleton", lambda n: skel[(n,)](x, y, BLOCK=256, num_warps=8))]:
    for n in [1, 64, 132, 264, 512, 528, 1024, 2048]:
        for _ in range(20): k(n)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(50): k(n)
            torch.cuda.synchronize()
        times = sorted(e.device_time for e in prof.events() if e.device_type.name == 'CUDA' and ('skel' in e.name or 'empty' in e.name))
        print(f"{name} grid {n}: median {times[len(times)//2]:.2f} us over {len(times)}")
