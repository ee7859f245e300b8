"""Measuring: devices (NVML, host memory), meters, and the isolated processes that run trials.

The only package that touches NVML or ``torch.cuda`` memory functions.
"""
