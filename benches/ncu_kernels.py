"""llama.cpp's decode kernels by name from an Nsight Compute raw CSV (`scripts/gpu.sh peers-gputime`):
time and launches a token, a token being SmolLM2-135M's 30 attention launches."""
import csv
import sys
from collections import defaultdict

LAYERS = 30

rows = list(csv.reader(open(sys.argv[1])))
head, units = rows[0], dict(zip(rows[0], rows[1]))
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[
    units["gpu__time_duration.sum"]
]
time, count = defaultdict(float), defaultdict(int)
for r in rows[2:]:
    d = dict(zip(head, r))
    name = d["Kernel Name"].split("(")[0].split("<")[0].removeprefix("void ")
    time[name] += float(d["gpu__time_duration.sum"].replace(",", "")) * scale
    count[name] += 1
# A token is a layer's attention launch (llama.cpp's flash-attention kernel, whichever variant
# it picks, not the parts' combine) in each layer.
attention = sum(c for n, c in count.items() if n.startswith("flash_attn_ext"))
tokens = max(1, attention) / LAYERS
total = sum(time.values()) / tokens
print(
    f"llama.cpp batch 1: {tokens:.1f} tokens profiled, {total:.1f} us of kernels a token, "
    f"{sum(count.values()) / tokens:.0f} launches"
)
for name, t in sorted(time.items(), key=lambda kv: -kv[1]):
    print(
        f"  {name[:40]:40} {t / tokens:8.1f} us a token ({100 * t / tokens / total:4.1f}%), "
        f"{count[name] / tokens:5.1f} launches"
    )
