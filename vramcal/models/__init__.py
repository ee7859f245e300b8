"""The model families vramcal builds (:mod:`vramcal.models.registry` says what differs between them), and the
Mamba-2 implementations they run (:mod:`vramcal.models.mamba2`). The only package that imports them."""
