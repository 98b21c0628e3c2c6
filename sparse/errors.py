"""Errors of the platform, rooted here so every layer can raise and catch them.

The CLI maps `MarianaError` to a one-line message and exit code 2; services map
them to error replies; serving maps them to 4xx answers.
"""


class MarianaError(Exception):
    """Base of every error that is the user's input, not a bug."""


class DataFormatError(MarianaError):
    """A data file is not in the format it was read as (wrong field count on
    most rows, a bad header, binary garbage)."""


class ConfigError(MarianaError):
    """A config key is unknown, has the wrong type or an invalid value."""


class ModelDirError(MarianaError):
    """A model directory is missing, empty or holds an unreadable version."""
