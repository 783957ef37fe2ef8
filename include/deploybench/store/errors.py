"""The results store's exception."""

from __future__ import annotations

from deploybench.errors import DeploybenchError


class StoreError(DeploybenchError):
    """The results database could not be reached, migrated, written or read.

    A failed write never leaves half a run behind: the message says so, and the
    previous version of the run (if any) is still in the database.
    """
