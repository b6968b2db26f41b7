"""Glue that lets other libraries load fastawq checkpoints with fastawq's kernels."""
