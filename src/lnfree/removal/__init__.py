"""The removal stage: a run's configuration, schedule, training loop and run folder."""
