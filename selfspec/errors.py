"""The one base class of user mistakes.

A `UserError` is something the person running selfspec can fix (a bad flag, config value, file or
checkpoint); its message is one line that names the problem and the fix. The CLI catches only this
class and prints that line; any other exception is a bug and keeps its traceback. It subclasses
`ValueError`, so library callers that catch `ValueError` keep working.
"""

from __future__ import annotations


class UserError(ValueError):
    """A user mistake; the message says what is wrong and how to fix it, in one line."""


__all__ = ["UserError"]
