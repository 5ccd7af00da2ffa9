"""CPU anchor for `kvplan generate --backend flex`: llama.cpp (llama-cpp-python) on the same GGUF and
prompts (benches/prompts.txt, first N, chat template from the GGUF), greedy, exactly NEW tokens
each, batch 1, prefill included; prints one CSV row.

usage: python3 benches/llama_cpp_anchor.py MODEL.gguf N NEW THREADS"""
import sys
import time

from llama_cpp import Llama

model, n, new, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=model, n_threads=threads, n_ctx=1024, verbose=False)
template = llm.metadata["tokenizer.chat_template"]
prompts = [line.strip() for line in open("benches/prompts.txt") if line.strip()][:n]


def render(message):
    from jinja2 import Template

    return Template(template, trim_blocks=True, lstrip_blocks=True).render(
        messages=[{"role": "user", "content": message}], add_generation_prompt=True
    )


def run(message):
    llm.reset()
    tokens = llm.tokenize(render(message).encode(), add_bos=False, special=True)
    llm.eval(tokens)
    for _ in range(new):
        token = llm.sample(top_k=1, temp=0.0)
        llm.eval([token])
    return new


run(prompts[0])
start = time.perf_counter()
total = sum(run(p) for p in prompts)
seconds = time.perf_counter() - start
print(f"llama.cpp,off,1,{total},{seconds:.3f},{total / seconds:.1f},{threads} threads")
