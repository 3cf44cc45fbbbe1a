"""`megatron-hetero profile`: timing kernels (model-free and the model's own) and the profile run."""
