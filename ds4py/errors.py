"""The one exception type the CLI turns into a clean one-line message and a non-zero exit."""


class Ds4Error(Exception):
    """A problem the user can act on. The message names the problem and what to do."""

    exit_code = 2


class ModelFileError(Ds4Error):
    """The GGUF file is unreadable, truncated, foreign or not a DS4 model."""


class ResourceError(Ds4Error):
    """Not enough memory, no GPU, or a filesystem that refuses what was asked."""

    exit_code = 3
