"""Weights conversion (`megatron-hetero convert`): Hugging Face weights to and from checkpoints."""
