"""Triton W4A16 kernels (installed as fastawq.triton_kernels)."""
