"""Data: datasets, energon readers, chat templates, tokenizers, image and speech processing."""
