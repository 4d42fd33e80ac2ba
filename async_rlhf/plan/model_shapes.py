"""What the planner needs to know about a model: its shape (layers, widths, heads, vocabulary) and parameter count.

A shape comes from a Hugging Face `config.json` (a model directory or the file itself; read as JSON, nothing is
loaded or downloaded) or from a size such as `8B`, which takes the standard shape of that size (the Llama 3 / Llama
2 shapes below; any other size gets a generic decoder of about that many parameters, shape marked `generic`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tie_embeddings: bool = False
    params_override: float | None = None  # a generic shape keeps the size asked for

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def params(self) -> float:
        if self.params_override is not None:
            return self.params_override
        h, kv = self.hidden, self.kv_heads * self.head_dim
        per_layer = h * h + 2 * h * kv + h * h + 3 * h * self.intermediate + 2 * h  # q, k+v, o, gated MLP, norms
        embeddings = self.vocab * h * (1 if self.tie_embeddings else 2)
        return float(self.layers * per_layer + embeddings + h)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> float:
        """KV cache of one token, all layers: keys and values of every KV head."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


# name: (layers, hidden, heads, kv_heads, intermediate, vocab, tied embeddings)
STANDARD = {
    "1B": (16, 2048, 32, 8, 8192, 128256, True),     # Llama 3.2 1B
    "3B": (28, 3072, 24, 8, 8192, 128256, True),     # Llama 3.2 3B
    "7B": (32, 4096, 32, 32, 11008, 32000, False),   # Llama 2 7B
    "8B": (32, 4096, 32, 8, 14336, 128256, False),   # Llama 3.1 8B
    "13B": (40, 5120, 40, 40, 13824, 32000, False),  # Llama 2 13B
    "70B": (80, 8192, 64, 8, 28672, 128256, False),  # Llama 3.1 70B
    "405B": (126, 16384, 128, 8, 53248, 128256, False),  # Llama 3.1 405B
}


def parse_size(text: str) -> float:
    """'8B' -> 8e9, '350M' -> 3.5e8, '1.5e9' -> 1.5e9."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kKmMbBtT]?)\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"model_size: expected a positive parameter count such as 8B, 350M or 1.5e9, got {text!r}")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]
    return float(m.group(1)) * scale


def shape_for_size(text: str) -> ModelShape:
    key = text.strip().upper()
    if key in STANDARD:
        return ModelShape(key, *STANDARD[key])
    params = parse_size(text)
    # a generic decoder: hidden = 128 x layers, 4x MLP (12 h^2 per layer), GQA with 8 KV heads, 128k vocabulary
    layers = max(2, round((params / (12 * 128**2)) ** (1 / 3)))
    hidden = 128 * layers
    heads = max(1, hidden // 128)
    return ModelShape(f"generic-{text.strip()}", layers, hidden, heads, min(8, heads), 4 * hidden, 128256,
                      params_override=params)


def shape_from_config(path: str) -> ModelShape:
    """The shape of a Hugging Face decoder from its `config.json` (or the directory holding it)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"model: {path!r} is neither a config.json nor a directory holding one")
    with open(file) as f:
        c = json.load(f)
    c = c.get("text_config", c)  # multimodal configs keep the language model's fields there
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size") if k not in c]
    if missing:
        raise ValueError(f"model: {file} lacks {missing}; pass --model_size instead")
    heads = c["num_attention_heads"]
    return ModelShape(os.path.basename(os.path.dirname(os.path.abspath(file))), c["num_hidden_layers"],
                      c["hidden_size"], heads, c.get("num_key_value_heads") or heads,
                      c.get("intermediate_size") or 4 * c["hidden_size"], c["vocab_size"],
                      bool(c.get("tie_word_embeddings", False)))


def resolve_model(model: str | None, model_size: str | None) -> ModelShape:
    if (model is None) == (model_size is None):
        raise ValueError("give exactly one of --model (a config.json or model directory) and --model_size (e.g. 8B)")
    return shape_from_config(model) if model is not None else shape_for_size(model_size)
