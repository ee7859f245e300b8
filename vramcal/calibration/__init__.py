"""Calibrating: the search policy, the fits, the limits, and the loop that runs trials (pure but for the loop)."""
