# Write-only and copy floors on this GPU, for the plan's bytes (4 x i64 outputs per entry).
import torch
def timed(fn, reps=50):
    fn(); torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); times.append(a.elapsed_time(b) * 1000)
    times.sort(); return times[len(times) // 2]
n = 8403335
outs = [torch.empty(n, dtype=torch.int64, device="cuda") for _ in range(4)]
src = torch.zeros(4 * n, dtype=torch.int64, device="cuda"); dst = torch.empty_like(src)
t = timed(lambda: [o.fill_(7) for o in outs])
print(f"fill 4 x {n} i64: {t:.1f} us, {4*n*8/t/1e6:.2f} TB/s (4 launches)")
big = torch.empty(4 * n, dtype=torch.int64, device="cuda")
t = timed(lambda: big.fill_(7))
print(f"fill 1 x {4*n} i64: {t:.1f} us, {4*n*8/t/1e6:.2f} TB/s")
t = timed(lambda: dst.copy_(src))
print(f"copy {4*n} i64: {t:.1f} us, {2*4*n*8/t/1e6:.2f} TB/s (read + write)")
