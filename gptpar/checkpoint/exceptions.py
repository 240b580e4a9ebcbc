"""The checkpoint package's errors. Every one names the path and the fix; the command lines print it on one line
(pretrain_gpt.py and the tools: exit 2 for a refusal before any weight is used, 1 for a save that failed)."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message names the path and the fix."""


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed (full disk, I/O error); the message names the folder and the cause."""


class ConversionError(CheckpointError):
    """Weights that cannot be read as a gptpar GPT, or written where asked; names the file and the problem."""


class UniversalCheckpointError(CheckpointError):
    """A checkpoint that cannot be converted to or read as a universal checkpoint; names the file and the fix."""


__all__ = ["CheckpointError", "CheckpointSaveError", "ConversionError", "UniversalCheckpointError"]
