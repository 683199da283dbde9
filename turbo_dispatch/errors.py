"""Exceptions raised by turbo_dispatch; each message names what was wrong and what was expected."""


class TurboDispatchError(RuntimeError):
    """Base class of turbo_dispatch's own errors."""


class RegistryError(TurboDispatchError):
    """A registry file (ours, an extra one, or a plugin's) is malformed."""


class ConfigError(TurboDispatchError, ValueError):
    """A backend setting (code or environment) names an unknown backend or precision."""


class BackendUnsupportedError(TurboDispatchError):
    """A pinned backend cannot serve the call; the message holds the reason."""


class NoBackendError(TurboDispatchError):
    """No registered backend can serve the call; the message lists each one's reason."""
