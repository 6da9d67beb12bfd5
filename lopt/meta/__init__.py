"""lopt.meta: meta-training learned optimizers in PyTorch (docs/meta_training.md)."""
