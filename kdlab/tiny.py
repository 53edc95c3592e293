"""kdlab's tiny world: a locally built tokenizer and tiny Qwen2 models, so nothing is downloaded.

``python -m kdlab.tiny random`` rebuilds ``kdlab/assets/tiny-random/{student,teacher}``
deterministically: random-initialised Qwen2 models (real ``transformers`` classes) sharing one
byte-level BPE tokenizer. The teacher's embedding matrix is padded past the vocabulary, as in
real model families (Qwen2.5: 151,936 vs 152,064 rows), so that code path is always exercised.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

import torch

from kdlab.models import ASSETS

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Tags are ordinary (non-special) added tokens: decoding keeps them, as verifiers need them.
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]
# Qwen-style chat template: the response ends with <|im_end|>, which is also the EOS token.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 512):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``corpus``, digits split one by one.

    Any text can be encoded (all 256 bytes are in the alphabet); ``<|im_end|>`` is EOS and
    ``<|endoftext|>`` is padding.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
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


def tiny_qwen2(vocab_size: int, hidden: int, layers: int, heads: int, embedding_rows: int | None = None, seed: int = 0):
    """A random-initialised ``Qwen2ForCausalLM`` with ``embedding_rows`` (default ``vocab_size``) rows."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=embedding_rows or vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def random_corpus() -> list[str]:
    """Text the tiny tokenizer is trained on: prompts and answers of kdlab's synthetic tasks."""
    from kdlab.tasks.addition import Addition

    task = Addition(num_train=2000, num_val=0, num_test=0)
    texts = [task.user_prompt(ex) + " " + task.reference_completion(ex) for ex in task.examples("train")]
    texts.append(CHAT_TEMPLATE)
    return texts


def build_random_pair(out_dir: Path) -> None:
    """Write ``student/`` and ``teacher/`` (random Qwen2, shared tokenizer) under ``out_dir``."""
    tokenizer = build_tokenizer(random_corpus(), vocab_size=512)
    vocab = len(tokenizer)
    models = {
        "student": tiny_qwen2(vocab, hidden=32, layers=2, heads=4, seed=1),
        "teacher": tiny_qwen2(vocab, hidden=64, layers=2, heads=4, embedding_rows=vocab + 64 - vocab % 64, seed=2),
    }
    for role, model in models.items():
        target = out_dir / role
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)
        print(f"wrote {target} ({sum(p.numel() for p in model.parameters()):,} parameters)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kdlab.tiny", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["random"], help="which packaged models to rebuild")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: the packaged one)")
    args = parser.parse_args(argv)
    build_random_pair(args.out or ASSETS / "tiny-random")


if __name__ == "__main__":
    main()
