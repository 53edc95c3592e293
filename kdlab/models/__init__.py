"""Models: loading (Hugging Face folders, ``kdlab://`` assets, ``pkg://`` GGUF files), depth pruning,
and export back to Hugging Face folders.

* :mod:`kdlab.models.loading`: ``ModelSpec``, ``load_causal_lm``, ``load_tokenizer``, vocabulary and
  end-token checks;
* :mod:`kdlab.models.pruning`: keep a subset of decoder layers;
* :mod:`kdlab.models.export`: stage checkpoints to Hugging Face names, LoRA merge, ``export_pretrained``.
"""

from kdlab.models.export import export_pretrained
from kdlab.models.loading import ModelSpec, load_causal_lm, load_config, load_tokenizer

__all__ = ["ModelSpec", "load_causal_lm", "load_config", "load_tokenizer", "export_pretrained"]


def __getattr__(name: str):
    """kdlab 0.1's names of this module path that moved (:data:`kdlab._legacy.MOVED`), with a FutureWarning."""
    from kdlab._legacy import moved_attribute

    return moved_attribute(__name__, name)
