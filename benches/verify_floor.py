# What random 256-byte strips cost on this GPU: the floor of a verify in mode ALL (issue 5).
#
# The verify benchmark's workload (src/bench.rs, `canary_workload`): entries are the tokens of
# ~2k-token requests whose slots are a random permutation of twice as many slots; each entry reads
# its plan fields (32 B, in order), its slot's record (32 B) and its predecessor's (24 B), both at
# random, and in mode ALL the slot's 256-byte real-KV strip, at random in an 8.6 GB source at 16M
# entries. Each Triton kernel here reads a subset of those bytes and writes nothing (a store only
# on a value that never occurs), so its time is a floor for a verify that reads the same bytes.
# Run on the GPU: `python3 benches/verify_floor.py`; medians of CUDA-event times.
import torch
import triton
import triton.language as tl


@triton.jit
def strips(slots, kv, out, n, BLOCK: tl.constexpr):
    # The real-KV strips alone: 64 i32 words at each entry's slot.
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = e < n
    slot = tl.load(slots + e, mask=live, other=0)
    words = tl.load(kv + slot[:, None] * 64 + tl.arange(0, 64)[None, :], mask=live[:, None], other=0)
    fold = tl.xor_sum(words, axis=1)
    tl.store(out + e, fold, mask=live & (fold == 0x7FFFFFFF))


@triton.jit
def verify_bytes(slots, prev, tokens, positions, records, kv, out, n, BLOCK: tl.constexpr,
                 WITH_KV: tl.constexpr):
    # Every byte a verify counts: plan fields, own record (4 x i64), predecessor record (3 x i64),
    # and with WITH_KV the strip.
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = e < n
    slot = tl.load(slots + e, mask=live, other=0)
    before = tl.load(prev + e, mask=live, other=0)
    token = tl.load(tokens + e, mask=live, other=0)
    position = tl.load(positions + e, mask=live, other=0)
    own = tl.load(records + slot[:, None] * 4 + tl.arange(0, 4)[None, :], mask=live[:, None], other=0)
    kept = tl.arange(0, 4)[None, :] < 3
    pred = tl.load(records + before[:, None] * 4 + tl.arange(0, 4)[None, :],
                   mask=live[:, None] & kept & (before[:, None] > 0), other=0)
    fold = tl.xor_sum(own, axis=1) ^ tl.xor_sum(pred, axis=1) ^ token ^ position
    if WITH_KV:
        words = tl.load(kv + slot[:, None] * 64 + tl.arange(0, 64)[None, :], mask=live[:, None], other=0)
        fold = fold ^ tl.xor_sum(words, axis=1).to(tl.int64)
    tl.store(out + e, fold.to(tl.int32), mask=live & (fold == 0x7FFFFFFF))


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    times.sort()
    return times[len(times) // 2]


def workload(entries, request_tokens=2048):
    num_slots = 2 * entries + 1
    gen = torch.Generator(device="cuda").manual_seed(entries)
    perm = torch.randperm(num_slots - 1, device="cuda", generator=gen) + 1
    slots = perm[:entries].contiguous()
    prev = torch.roll(slots, 1)
    prev[::request_tokens] = -1
    tokens = torch.arange(entries, device="cuda", dtype=torch.int64)
    positions = tokens % request_tokens
    records = torch.zeros(num_slots * 4, dtype=torch.int64, device="cuda")
    kv = torch.randint(0, 1 << 30, (num_slots * 64,), dtype=torch.int32, device="cuda")
    return slots, prev, tokens, positions, records, kv


for entries in (1 << 20, 1 << 24):
    slots, prev, tokens, positions, records, kv = workload(entries)
    out = torch.empty(entries, dtype=torch.int32, device="cuda")
    for block in (32, 64, 128):
        grid = (triton.cdiv(entries, block),)
        t = timed(lambda: strips[grid](slots, kv, out, entries, BLOCK=block))
        print(f"{entries} entries, BLOCK {block}: strips only {t:.1f} us, "
              f"{entries * 256 / t / 1e6:.2f} TB/s of strips")
        for with_kv, per_entry, name in ((False, 88, "NONE bytes"), (True, 344, "ALL bytes")):
            t = timed(lambda: verify_bytes[grid](slots, prev, tokens, positions, records, kv, out,
                                                 entries, BLOCK=block, WITH_KV=with_kv))
            print(f"{entries} entries, BLOCK {block}: {name} {t:.1f} us, "
                  f"{entries * per_entry / t / 1e6:.2f} TB/s")
    del slots, prev, tokens, positions, records, kv, out
    torch.cuda.empty_cache()
