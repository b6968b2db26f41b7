"""Seed-OSS: Llama's layout with q/k/v (and optionally o) biases."""
from fastawq.models.base import Architecture

ARCH = Architecture(name="seed_oss", family="Seed-OSS", model_types=("seed_oss",))
