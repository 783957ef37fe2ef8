"""Exception classes. Every message names the value at fault and the way out."""

from typing import Any


class DeploybenchError(Exception):
    """Base class for errors deploybench raises on purpose."""


class ConfigError(DeploybenchError, ValueError):
    """A run parameter or an inventory is invalid; nothing has touched a node yet."""


class TransportError(DeploybenchError):
    """A command or a file could not reach a node."""


class NodeUnreachable(TransportError):
    """A node could not be connected to at all (refused, timed out, host key rejected)."""


class StageFailed(DeploybenchError):
    """A pipeline stage finished, but its result does not allow the run to go on.

    ``result`` carries what the stage measured anyway, so it is stored with the run.
    """

    def __init__(self, message: str, result: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.result = result


class LabError(DeploybenchError):
    """The embedded lab cluster could not be built, inspected or removed."""
