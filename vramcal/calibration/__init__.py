"""The calibration core, pure: the fits, the limits, the search policy, the surface over lengths and the step
creep, each a function of recorded trials (tested with recorded and synthetic ones). The loop that runs real
trials against it is :mod:`vramcal.service.calibrator`, above the profile. Its records are
:class:`vramcal.schema.Record`s."""
