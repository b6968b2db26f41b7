"""Mixtral 8x7B / 8x22B: Mistral attention; every layer an MoE block. Checkpoints name the block
`block_sparse_moe` and the experts' linears w1 (gate), w3 (up), w2 (down), as vLLM reads them;
transformers 5.x calls the block `mlp`."""
from fastawq.models.moe import MoESpec, moe_architecture

MOE = MoESpec(proj_names=("w1", "w3", "w2"), checkpoint_block="block_sparse_moe")

ARCH = moe_architecture("mixtral", "Mistral", MOE)
