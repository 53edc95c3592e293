"""A byte-level BPE tokenizer built locally with ``tokenizers``, saved as a standard HF tokenizer."""

from __future__ import annotations

from collections.abc import Iterable

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Tags are ordinary (non-special) added tokens: decoding keeps them, as verifiers need them.
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]
# Qwen-style chat template: the response ends with <|im_end|>, which is also the EOS token.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 512, *, individual_digits: bool = True):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``corpus``, digits split one by one.

    Any text can be encoded (all 256 bytes are in the alphabet); ``<|im_end|>`` is EOS and
    ``<|endoftext|>`` is padding. ``individual_digits=False`` keeps runs of digits together, so BPE
    can merge them ("24" one token, as in many real vocabularies); the special tokens, tags and chat
    template are the same either way. Saved next to a Qwen2 model, transformers 5 loads it as
    ``Qwen2Tokenizer``, whose own pre-tokenizer splits digits one by one: merged digits need another
    family's folder (:data:`kdlab.tiny.xtok.TEACHER_XTOK` with ``architecture: llama``; the packaged
    ``kdlab://tiny/teacher-xtok`` is a Qwen2 folder, so it loads splitting digits).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=individual_digits), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.add_tokens(TAG_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    return fast
