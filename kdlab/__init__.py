"""kdlab: strong-to-weak distillation of language models, as a PyTorch Lightning research library.

Where each concept lives: ``docs/package_map.md``."""

from kdlab import _legacy

__version__ = "0.1.0"

_legacy.install()
