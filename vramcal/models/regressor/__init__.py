"""The regressor family: a Mamba-2 regressor over windows of OHLCV bars. Profiles name its factory
``vramcal.models.regressor:training_step``, handed on here."""

from vramcal.models.regressor.spec import FACTORY, N_FEATURES, RegressorSpec
from vramcal.models.regressor.step import training_step

__all__ = ["FACTORY", "N_FEATURES", "RegressorSpec", "training_step"]
