"""Training: layer dropout, early-exit losses, the objective module and the accelerate loop.

Import the submodules directly (`selfspec.training.loop`); this package imports nothing eagerly so that
the light pieces (schedules, losses) load without accelerate.
"""
