"""The one exception type the command line turns into a single-line message and a non-zero exit."""


class EdgeMTPError(Exception):
    """A problem with the user's input, named with its fix."""
