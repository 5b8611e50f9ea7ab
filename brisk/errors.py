"""User-facing errors.

A `BriskError` is a mistake a person can fix (a bad path, a corrupt file, an
unwritable directory). Its message is one line: what was wrong, with the value,
and what to do. The CLI prints it without a traceback and exits with code 2.
Anything else that escapes is a bug and keeps its traceback.
"""


class BriskError(Exception):
    """An error caused by input or environment, reported as one clear line."""


class ModelLoadError(BriskError):
    """A model source that cannot be read: missing, corrupt, or unsupported."""


class CacheDirError(BriskError):
    """The cache directory ($BRISK_CACHE) cannot be used."""


class ParamError(ValueError):
    """A request field with a bad value; the message starts with the field's name."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message
