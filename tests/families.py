"""Tiny random models of every supported family, built from configs (nothing is downloaded)."""

from __future__ import annotations

import torch
from transformers import (
    Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig,
    LlamaForCausalLM, MistralConfig, MistralForCausalLM, Olmo2Config, Olmo2ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
    Qwen3Config, Qwen3ForCausalLM,
)

FAMILIES = ["gpt2", "llama", "mistral", "qwen2", "qwen3", "neox-parallel", "neox-sequential", "gemma3", "olmo2"]


def tiny_family(family: str, vocab_size: int = 64, seed: int = 0, eos_token_id: int = 0):
    """A 2-block random model of `family` with non-trivial norm weights and biases, in eval mode."""
    torch.manual_seed(seed)
    common = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  vocab_size=vocab_size, max_position_embeddings=64, bos_token_id=eos_token_id,
                  eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=vocab_size,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                           bos_token_id=eos_token_id, eos_token_id=eos_token_id))
    elif family == "llama":  # grouped-query attention, tied head
        model = LlamaForCausalLM(LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=True))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, num_key_value_heads=2, tie_word_embeddings=False))
    elif family == "qwen2":  # biases on q/k/v
        model = Qwen2ForCausalLM(Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False))
    elif family.startswith("neox"):
        model = GPTNeoXForCausalLM(GPTNeoXConfig(**common, use_parallel_residual=family == "neox-parallel",
                                                 attention_dropout=0.0, hidden_dropout=0.0))
    elif family == "gemma3":  # sandwich norms, (1 + weight) RMSNorms, one sliding-window and one global layer
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            **common, num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True))
    elif family == "olmo2":  # output norms only; q/k norms over the whole projection
        model = Olmo2ForCausalLM(Olmo2Config(**common, num_key_value_heads=2, tie_word_embeddings=False))
    else:
        raise ValueError(family)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                if name.endswith("weight"):
                    param.uniform_(0.5, 1.5)
                else:
                    param.normal_(0, 0.1)
    return model.eval()
