"""Tiny Llama-style models and a character tokenizer built in code (no hub): the toy task's policy and the
models tests train."""

from __future__ import annotations

import string

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII with pad/eos/bos and a chat template, built locally."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(string.printable))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def tiny_llama(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,  # head size 32: vLLM's CPU attention supports head sizes 32, 64, 80, ...,
    max_position_embeddings: int = 256,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A randomly initialised Llama-style causal LM sized for CPU tests (about 0.1M parameters at defaults)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def save_tiny_model(path: str, **kwargs) -> str:
    """Build a tiny model with the char tokenizer and save both to `path`; returns `path`."""
    tokenizer = char_tokenizer()
    model = tiny_llama(tokenizer, **kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
