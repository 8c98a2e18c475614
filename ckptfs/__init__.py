"""ckptfs: a FUSE filesystem for ML training checkpoints."""

__version__ = "0.1.0"
