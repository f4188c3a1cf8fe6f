"""adloco inside other trainers: the Hugging Face ``transformers.Trainer`` (``hf``) and PyTorch Lightning
(``lightning``), optional extras that import their framework only when used."""
