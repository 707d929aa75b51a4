"""deggs: distributed EGGROLL, gradient-free training of int8 transformer language models."""

__version__ = "0.1.0"
