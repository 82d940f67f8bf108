"""What serves the models: the ``Server``, its batcher and scheduling policy, metrics,
the model repository."""
