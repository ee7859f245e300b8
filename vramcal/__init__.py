"""vramcal: empirical GPU-memory profiler and batch-size calibrator for Mamba-2 training.

Importing this package imports no torch, triton, NVML or mamba_ssm: those load lazily in the device,
meter and model layers, so ``vramcal --help`` works on a machine with no GPU.
"""

__version__ = "0.1.0"
