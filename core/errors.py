"""Errors that name the problem: the file, tensor, key or value at fault."""


class TrellmError(Exception):
    """Base class of every error trellm raises on bad input."""


class ConfigError(TrellmError):
    """config.json is missing, unreadable, or holds an unsupported value."""


class UnknownArchitectureError(TrellmError):
    """No installed plugin serves the model's architecture."""


class ArchitectureConflictError(UnknownArchitectureError):
    """Several installed plugins serve the model's architecture and none was chosen."""


class WeightError(TrellmError):
    """A safetensors file is corrupt, or a tensor is missing or wrongly shaped."""


class TokenizerError(TrellmError):
    """Tokenizer files are missing or do not match the model."""


class UsageError(TrellmError, ValueError):
    """An argument is out of range or does not fit this machine (device, dtype, sampling value)."""


class PromptTooLongError(UsageError):
    """A prompt does not fit the model's context (or the cache); the message names both numbers."""
