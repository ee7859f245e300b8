"""The trainer's errors (importing them loads no torch: the command line catches them)."""


class TrainError(RuntimeError):
    """A run that cannot go on; the one-line message says why and where the last good checkpoint is."""


class NonFiniteError(TrainError):
    """The loss or the gradient norm became NaN or infinite."""


class DivergedError(TrainError):
    """The loss is far above the zero-return baseline, or rose through a whole epoch (the LR is too high)."""


class Stopped(TrainError):
    """The caller asked the run to stop after an epoch (``vramcal tune`` pruning a trial)."""
