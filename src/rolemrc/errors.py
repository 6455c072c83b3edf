"""Errors the user can fix (bad input, a bad path, a missing key). The entry scripts report
them as one ``error: <message>`` line on stderr and exit status 1, no traceback
(:func:`exit_on_user_error`, inside :func:`rolemrc.entry.entry_point`); any other exception is a bug and keeps its traceback.

Raise a subclass of :class:`UserError` (it also subclasses the built-in error a caller would
catch, e.g. ``ValueError``) with a message that names the file, line, field or config key.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


class UserError(Exception):
    """Bad input: the message alone tells the user what to fix."""


class ConfigError(UserError, ValueError):
    """A config value no run can satisfy; the message names the key."""


class InputNotFound(UserError, FileNotFoundError):
    """A path given in the config or on the command line does not exist."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be read (truncated, corrupt, not a checkpoint); names the path."""


class ModelSourceError(UserError, OSError):
    """``model.path`` (or another model key) names something that cannot be loaded as a model."""


class MissingAPIKey(UserError, RuntimeError):
    """An API key's environment variable is not set; the message names the variable."""


class StorageError(UserError, OSError):
    """A file or folder that cannot be written or read for a reason of the storage (a full disk,
    a read-only or misnamed folder); the message names the path and what to do."""


class DestinationError(UserError, FileExistsError):
    """An output folder that would replace something the command did not write (a folder of other
    files, a run folder, a file); the message names the path and how to write elsewhere."""


class DataUnavailable(UserError, ConnectionError):
    """A data set that cannot be fetched (the hub offline or unreachable, no local copy); the
    message names what needed it and how to make it available."""


@contextmanager
def exit_on_user_error() -> Iterator[None]:
    """A :class:`UserError` ends the process with ``error: <message>`` on stderr and exit status
    1 (``SystemExit`` passes through Hydra untouched); any other exception keeps its traceback."""
    try:
        yield
    except UserError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
