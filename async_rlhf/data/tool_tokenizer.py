"""A tool-calling tokenizer built in code (no hub): TRL 1.16's own chat template and response parser, over a small
vocabulary learned from the task's text.

What TRL's `GRPOTrainer` asks of a tokenizer when `tools=` or `environment_factory=` is given
(`trl/trainer/grpo_trainer.py`, `trl/chat_template_utils.py`):
- `supports_tool_calling`: the template renders user -> assistant with `tool_calls` -> tool, keeping the call's name,
  arguments and the tool's answer;
- a `response_template` (or legacy `response_schema`), else `add_response_schema` must recognise the template;
- `is_chat_template_prefix_preserving`, else `get_training_chat_template` must have a patch for it;
- `parse_response` turning the sampled ids back into `tool_calls`: the parser reads the *decoded text*, so decoding
  must give back exactly the text the template renders (newlines and spaces included).

Our choice: TRL's training variant of the Qwen3-Instruct-2507 template (`qwen3_instruct_2507_training.jinja`:
prefix-preserving, with generation markers), and `qwen3_template`, the response template TRL's
`add_response_schema` pairs with the original of that template (set here because the training variant is not one
the function recognises; it is saved with the tokenizer). EOS is `<|im_end|>`, the end of an assistant turn, as in
Qwen's own tokenizers, so TRL's `_get_tool_suffix_ids` cuts the tool suffix at the right place.

The vocabulary is phrases plus characters: byte-level BPE whose merges are learned from `corpus` (the template's
boilerplate and the task's texts) without splitting at spaces, so the phrases that recur become single tokens (a
guess call is 8 ids, the tool schema's system block about 60 instead of about 230 with one token a word: a tiny
policy trains and samples 2-4 times faster), numbers are tokens of their own, and any other text falls back to bytes
and still round-trips exactly. The template's markers (`<|im_start|>`, `<tool_call>`, ...) are added tokens: text is
split at them, so a stretch between two markers tokenizes the same whether it is encoded alone or inside a whole
conversation. A plain whitespace word tokenizer passes TRL's checks too, but decodes `<tool_call>\\n{...}` without its
newlines and spaces, and the parser never finds a tool call in it.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from trl.chat_template_utils import qwen3_instruct_2507_training_chat_template, qwen3_template

PAD, EOS, START = "<|endoftext|>", "<|im_end|>", "<|im_start|>"
# Qwen's markers that are added but not special: kept by `decode(skip_special_tokens=True)`, as the parser needs them
MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>", "<think>",
           "</think>")
CHAT_TEMPLATE = qwen3_instruct_2507_training_chat_template
RESPONSE_TEMPLATE = qwen3_template


def _wrap(tok: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=None,
        additional_special_tokens=[START],
        model_max_length=model_max_length,
        padding_side="left",  # generation pads on the left
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens(list(MARKERS))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def template_renderer() -> PreTrainedTokenizerFast:
    """A tokenizer with no merges, for rendering conversations to text (`tokenize=False`) before the vocabulary
    exists: the corpus of `build_tool_tokenizer` is rendered with it."""
    return _wrap(_bare(), 4096)


def _bare() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\d+"), behavior="isolated"),  # numbers apart: "12" one token, never " 12}}"
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),  # no split at spaces: phrases merge
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def build_tool_tokenizer(corpus: list[str], model_max_length: int = 1024) -> PreTrainedTokenizerFast:
    """The tokenizer: merges learned from `corpus` (rendered conversations), TRL's template and response template.
    Deterministic: the same corpus gives the same ids."""
    tok = _bare()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,  # an upper bound (the guessing task stops at about 700)
        special_tokens=[PAD, START, EOS, *MARKERS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tokenizer = _wrap(tok, model_max_length)
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer
