"""The one exception type the command line turns into a single-line message and a non-zero exit."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class EdgeMTPError(Exception):
    """A problem with the user's input, named with its fix."""


# What a parser of outside input trips over on a field that is missing or of the wrong type,
# shape or range, before its own checks could name it.
MALFORMED = (
    KeyError,
    TypeError,
    ValueError,
    AttributeError,
    IndexError,
    ArithmeticError,  # a zero or huge count
    RecursionError,
)


@contextmanager
def malformed_input(where: str, what: str, fix: str) -> Iterator[None]:
    """Turn a malformed field met while parsing `where` into one `EdgeMTPError` line that
    names the file, what it should have been and the fix; errors already named pass through."""
    try:
        yield
    except EdgeMTPError:
        raise
    except MALFORMED as err:
        detail = f"missing {err}" if isinstance(err, KeyError) else " ".join(str(err).split())
        raise EdgeMTPError(
            f"{where}: malformed {what} ({detail[:160] or type(err).__name__}); {fix}"
        ) from None
