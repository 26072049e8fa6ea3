"""What a failed start-up of ``trident serve`` raises: a reason the user can act on, printed as one line (exit 1)
instead of a traceback."""


class StartupError(RuntimeError):
    pass
