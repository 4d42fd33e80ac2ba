"""The built-in task's tokenizer: byte-level BPE built locally with the `tokenizers` library, no hub.

Why byte-level BPE and not a hand-made word vocabulary: it is the kind of tokenizer every tool in the chain
(transformers, TRL, vLLM's incremental detokenizer) handles natively, it round-trips any completion text
exactly, and it can still encode text outside the task's vocabulary. Its merges are learned from a fixed corpus
(the task vocabulary and prompt template, not the seeded data), so every task word, with its leading space, is
one token and the tokenizer does not depend on the seed.

`add_prefix_space=True` applies to every stretch of text between special tokens, so " cat vet." after "TL;DR:"
and "cat vet." after the chat template's `<|assistant|>` become the same tokens: one SFT model serves the plain
and the conversational formats of the task.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from async_rlhf.data.builtin_task import PROMPT_TEMPLATE, TOPICS, VOCABULARY

PAD, EOS = "<|pad|>", "<|endoftext|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")

# Assistant turns end with EOS and nothing after it, so TRL's prompt/completion split of a rendered conversation
# trains the model to stop; other turns end with a newline.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def _corpus(vocabulary: tuple[str, ...]) -> list[str]:
    words = " ".join(vocabulary)
    prompts = [PROMPT_TEMPLATE.format(topic=topic, post=words) for topic in sorted(TOPICS)]
    return prompts * 4 + [words + "."] * 4


def build_tokenizer(model_max_length: int = 512, vocabulary: tuple[str, ...] = VOCABULARY) -> PreTrainedTokenizerFast:
    """The task tokenizer with pad, eos (also bos) and a chat template. Deterministic: same vocabulary every call.
    `vocabulary`: the words that must be one token each (default: the built-in task's; the long-tail task passes
    its larger one)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,  # an upper bound: training stops once every corpus word is a single token
        special_tokens=[PAD, EOS, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(vocabulary), trainer)
    for word in vocabulary:
        assert len(tok.encode(" " + word).ids) == 1, f"task word {word!r} is not a single token"
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=EOS,
        unk_token=None,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=model_max_length,
        padding_side="left",  # generation pads on the left; training code sets right padding where it needs it
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
