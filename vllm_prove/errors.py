"""The project's own error type for input a user can fix (a setting, a file, a flag).

`ProveError` subclasses `ValueError`, so callers that catch `ValueError` keep working; the CLI
prints exactly these (and pydantic's `ValidationError`) on one line with exit status 2, while
any other exception keeps its traceback: a bug must stay visible.
"""


class ProveError(ValueError):
    """Invalid settings or input; the message names the field, file or flag and what is allowed."""
