"""A Llama-shaped 1.1B model from transformers (TinyLlama's shape: 22 layers, width 2048, SwiGLU 5632, 32 query
heads over 4 key-value heads, RMSNorm, vocabulary 32000), random token ids as the batch, the model's own loss, AdamW:
the second family of fit's CUDA truth, with grouped-query attention where GPT-2 has none. No GPU has measured its
rows yet (results/README.md says which to measure first, and how)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

NAME = "llama_1b"
PARAMETERS = {"batch_size": 8, "seq_len": 2048}
QUICK = {"batch_size": 1, "seq_len": 16}


def model(batch_size, seq_len):
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
    return LlamaForCausalLM(config).train()


def batch(batch_size, seq_len):
    return (torch.randint(0, 32000, (batch_size, seq_len)),)


def loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def optimizer(parameters):
    return torch.optim.AdamW(parameters, lr=1e-4)
