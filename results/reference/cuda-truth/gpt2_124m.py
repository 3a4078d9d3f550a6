"""GPT-2 124M from transformers, as gpt2_124m_h200.csv measured it: 12 layers, width 768, vocabulary 50257, no
dropout, random token ids as the batch, the model's own loss, AdamW. `benchlib fit` on it predicts each truth row
(tests/test_cuda_truth.py): the table's benchlib rows are this file's `benchlib fit --device cuda` on the GPU."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

NAME = "gpt2_124m"
PARAMETERS = {"batch_size": 8, "seq_len": 1024}
QUICK = {"batch_size": 1, "seq_len": 32}


def model(batch_size, seq_len):
    config = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024, resid_pdrop=0,
                        embd_pdrop=0, attn_pdrop=0)
    return GPT2LMHeadModel(config).train()


def batch(batch_size, seq_len):
    return (torch.randint(0, 50257, (batch_size, seq_len)),)


def loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def optimizer(parameters):
    return torch.optim.AdamW(parameters, lr=1e-4)
