"""The transformers side of the decoder's anchors: SmolLM2-135M from the GGUF kvplan serves
(dequantized to float32 by transformers), on the GPU, and benches/prompts.txt rendered with its
chat template."""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def load(directory, file):
    """(tokenizer padding on the left, model, chat-rendered prompts)."""
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=file)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file, dtype=torch.float32)
    model = model.cuda().eval()
    prompts = [line.strip() for line in open("benches/prompts.txt") if line.strip()]
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    return tok, model, texts
