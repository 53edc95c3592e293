"""kdlab: strong-to-weak distillation of language models, as a PyTorch Lightning research library."""

__version__ = "0.1.0"
