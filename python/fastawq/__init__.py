"""fastawq: 4-bit AWQ quantization and fast W4A16 inference."""
__version__ = "0.1.0"
