"""--workers: the supervisor (the device process) and the worker processes that forward to it."""
