"""The strongest transformers peer for `kvplan generate` on one GPU: a static KV cache, and generate()
compiling its decoding forward with CUDA graphs (reduce-overhead), float32, on the same GGUF
(dequantized by transformers) and prompts (benches/prompts.txt, chat template), greedy, exactly NEW
tokens per request; batch 1 runs four prompts one at a time, as `kvplan generate --batch 1 --limit 4`.

usage: python3 benches/hf_graphs.py DIR FILE.gguf [NEW]   (one CSV row per batch; HF_BATCHES picks
them, default "1 8 32"). Each batch's shapes are compiled and captured in two untimed rounds first."""
import os
import sys
import time

import torch
from hf_model import load
from transformers import CompileConfig

directory, file = sys.argv[1], sys.argv[2]
new = int(sys.argv[3]) if len(sys.argv) > 3 else 128
tok, model, texts = load(directory, file)
# generate() compiles the decoding forward itself when the cache is static; compiling forward by
# hand breaks the cache's buffers.
model.generation_config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")


def generate(batch):
    enc = tok(batch, return_tensors="pt", padding=True).to("cuda")
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=tok.pad_token_id, cache_implementation="static")
    return out.shape[0] * (out.shape[1] - enc["input_ids"].shape[1])


print("engine,mode,dtype,batch,tokens,seconds,tokens_per_s", flush=True)
for bs in [int(b) for b in os.environ.get("HF_BATCHES", "1 8 32").split()]:
    runs = [[t] for t in texts[:4]] if bs == 1 else [texts[:bs]]
    start = time.perf_counter()
    for _ in range(2):
        for run in runs:
            generate(run)
    print(f"# warm-up batch {bs}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = sum(generate(run) for run in runs)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(f"transformers,graphs,f32,{bs},{tokens},{seconds:.3f},{tokens / seconds:.1f}", flush=True)
