"""One exception type and one message shape for every user mistake ddpkit detects.

Every message says what is wrong (echoing the user's values), where the conflict comes from,
and ends with the fix, so a user can act on the one paragraph they see.
"""

from __future__ import annotations


class DdpkitError(RuntimeError):
    """A configuration or usage error the user can fix; the message names the fix."""


def problem(what: str, fix: str, *, source: str | None = None) -> DdpkitError:
    """Build a `DdpkitError` of the shape "<what> (<source>). <fix>"."""
    text = what.rstrip(".")
    if source:
        text += f" ({source})"
    return DdpkitError(f"{text}. {fix.rstrip('.')}.")
