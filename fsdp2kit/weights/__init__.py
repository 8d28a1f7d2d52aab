"""Filling and emptying sharded models: meta-device init, pretrained Hugging Face weights in, exports out."""
