"""Integrations with training frameworks, each optional: importing :mod:`vramcal` imports none of them.

- :mod:`vramcal.integrations.lightning`: :class:`~vramcal.integrations.lightning.VramcalBatchSize`, a
  Lightning callback that applies a profile's batch size and checks the run's peak against it
  (needs ``lightning``).
"""
