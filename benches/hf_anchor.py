"""Anchor for `kvplan generate` on the GPU: Hugging Face transformers (eager PyTorch, float32) on the
same GGUF (dequantized by transformers), same prompts (benches/prompts.txt, chat template), greedy,
exactly NEW tokens per request; plain, with prompt lookup (`prompt_lookup_num_tokens`), and with
self-speculative early exit (`assistant_early_exit`, LayerSkip's: the first 26 of 30 layers
draft 4 tokens, as `kvplan generate --spec self --draft-confidence 0`; and stopping under a draft
probability of 0.4, as `--spec self`).

usage: python3 benches/hf_anchor.py DIR FILE.gguf [NEW]   (prints one CSV row per run; ANCHOR_BATCHES
picks batch sizes, default "1 8 32")
transformers' assisted generation (prompt lookup) takes one sequence at a time, so at batch > 1
its requests run one after another (`sequential` in the row)."""
import os
import sys
import time

import torch
from hf_model import load

directory, file = sys.argv[1], sys.argv[2]
new = int(sys.argv[3]) if len(sys.argv) > 3 else 128
tok, model, texts = load(directory, file)


MODES = {
    "off": {},
    "prompt_lookup": {"prompt_lookup_num_tokens": 10},
    "early_exit": {"assistant_early_exit": 26, "num_assistant_tokens": 4, "num_assistant_tokens_schedule": "constant"},
    "early_exit_confidence": {
        "assistant_early_exit": 26,
        "num_assistant_tokens": 4,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.4,
    },
}


def generate(batch, mode):
    enc = tok(batch, return_tensors="pt", padding=True).to("cuda")
    extra = MODES[mode]
    out = model.generate(
        **enc, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id, **extra
    )
    return out.shape[0] * (out.shape[1] - enc["input_ids"].shape[1])


generate(texts[:2], "off")
generate(texts[:1], "prompt_lookup")
generate(texts[:1], "early_exit")
print("engine,mode,batch,tokens,seconds,tokens_per_s,note")
for bs in [int(b) for b in os.environ.get("ANCHOR_BATCHES", "1 8 32").split()]:
    # Assisted generation takes one sequence at a time: early exit runs at batch 1 only.
    modes = ("off", "prompt_lookup", "early_exit", "early_exit_confidence") if bs == 1 else ("off", "prompt_lookup")
    for mode in modes:
        batch = texts[:bs] if bs > 1 else texts[:4]
        torch.cuda.synchronize()
        start = time.perf_counter()
        if bs == 1 or mode != "off":
            tokens = sum(generate([t], mode) for t in batch)
        else:
            tokens = generate(batch, mode)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        note = "sequential" if mode != "off" and bs > 1 else ("4 prompts one at a time" if bs == 1 else "")
        print(f"transformers,{mode},{bs},{tokens},{seconds:.3f},{tokens / seconds:.1f},{note}", flush=True)
