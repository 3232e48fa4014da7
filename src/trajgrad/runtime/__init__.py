"""Settings of the training process itself, outside the model and the objective.

* :mod:`~trajgrad.runtime.allocator`: keep freed memory in the process from one step to the
  next (glibc's ``mallopt``; ``train.keep_freed_mb``).
"""
