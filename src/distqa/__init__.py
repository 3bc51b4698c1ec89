"""distqa: fine-tune a BERT-style model on Natural Questions with PyTorch DDP, one container per node."""

__version__ = "0.1.0"
