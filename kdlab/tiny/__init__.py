"""kdlab's tiny world: a locally built tokenizer and tiny Qwen2 models, so nothing is downloaded.

``python -m kdlab.tiny random`` rebuilds ``kdlab/assets/tiny-random`` (random-initialised pair);
``python -m kdlab.tiny world`` rebuilds ``kdlab/assets/tiny`` (trained teacher and student);
``python -m kdlab.tiny reasoning`` rebuilds ``kdlab/assets/tiny-reasoning`` (the tiny reasoning world:
the same teacher, a student that writes the task's format but slips in its arithmetic).
"""

from kdlab.tiny.build import build_random_pair, tiny_qwen2
from kdlab.tiny.tokenizer import CHAT_TEMPLATE, build_tokenizer

__all__ = ["CHAT_TEMPLATE", "build_random_pair", "build_tokenizer", "tiny_qwen2"]
