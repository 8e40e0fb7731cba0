"""scaletrain: the techniques of large-scale training for PyTorch, composable from one config file."""

__version__ = "0.1.0"
