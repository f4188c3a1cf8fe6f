"""adloco: low-communication distributed training of language models."""

__version__ = "0.1.0"
