"""The service under the facade: devices, the worker pool and running a calibration, which the commands, train/
and integrations/ call (:mod:`vramcal.api` is the public facade over it)."""
