"""hp-runtime: a parallel Llama-style model and trainer built on torch.distributed."""

__version__ = "0.1.0"
