"""The regressor family: a Mamba-2 regressor over windows of OHLCV bars, and its training step.

One package, a file per concept: :mod:`~vramcal.models.regressor.spec` (its shape, the profile key),
:mod:`~vramcal.models.regressor.net` (the ``nn.Module``), :mod:`~vramcal.models.regressor.bars` (bar
files and the E-mini sample), :mod:`~vramcal.models.regressor.windows` (features, windows, the split) and
:mod:`~vramcal.models.regressor.step` (the data pipeline and :func:`training_step`, the factory that
``vramcal probe`` calibrates and ``vramcal train`` trains). Profiles name the factory as
``vramcal.models.regressor:training_step``, so it is handed on here.
"""

from vramcal.models.regressor.spec import FACTORY, N_FEATURES, RegressorSpec
from vramcal.models.regressor.step import training_step

__all__ = ["FACTORY", "N_FEATURES", "RegressorSpec", "training_step"]
