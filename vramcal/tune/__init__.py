"""``vramcal tune``: an optuna study whose batch sizes come from the profile, and its results."""
