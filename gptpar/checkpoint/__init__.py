"""Checkpoints: the on-disk format, the durable write, the verification on every read, the readers."""
