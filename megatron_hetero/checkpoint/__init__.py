"""Checkpoints: save and load under any layout, the file format, the restricted unpickler, and
converted (weights-only) checkpoints."""
