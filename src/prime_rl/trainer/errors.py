"""User-facing trainer errors (bad inputs, not bugs): the entrypoint logs them as one line and exits 1."""


class TrainerError(RuntimeError):
    pass
