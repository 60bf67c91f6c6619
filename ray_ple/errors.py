"""Errors a user sees.

Every bad input is reported as one `PleError` subclass before anything is published to the
other side of a pair; runtime loss of correspondence never raises these, it ends the replica
through `ray_ple.protocol.fatal.fail_closed`.
"""


class PleError(Exception):
    """A clear, user-facing setup error (config, handle, geometry, environment)."""


class PleConfigError(PleError, ValueError):
    """The `ple:` block or the engine settings it depends on are invalid (a bad value)."""


class PleModelError(PleError):
    """The checkpoint has no PLE table, or one ray-ple cannot offload."""


class PleHandleError(PleError):
    """A handle does not match the segment, the layout or the worker's model."""


class PleShmError(PleError):
    """Shared memory could not be created or mapped (size, permissions, /dev/shm)."""


class PleEnvironmentError(PleError):
    """The process environment cannot run this transport (CUDA, memlock, platform)."""


class PleTokenCountError(PleError):
    """A step carries more tokens than the slots were sized for."""
