"""The bundled trainer: a Mamba-2 model on OHLCV bars, sized by a calibrated profile."""
