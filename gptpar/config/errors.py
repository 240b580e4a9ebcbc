"""The one error every part of the run config raises: its message names `section.key` and the fix."""


class ConfigError(ValueError):
    """A configuration that cannot run; the message names `section.key` and how to fix it."""


__all__ = ["ConfigError"]
