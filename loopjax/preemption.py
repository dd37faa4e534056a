"""A preempted trainer saves the step it stops at: SIGTERM and SIGINT become a
flag the training loop reads after each step (train.py)."""

import signal

import jax
from jax.experimental import multihost_utils


class Preemption:
  """Once armed, SIGTERM/SIGINT set a flag the loop checks after each step.

  Armed after the first step, whose call compiles: until then there is
  nothing to save and a compile can run for minutes, so the signals keep
  their default action (SIGTERM ends the process at once). With several
  processes, all must stop after the same step (a save is collective): JAX's
  preemption service hears SIGTERM and `reached_preemption_sync_point` tells
  every process the same step, so the handlers stay JAX's.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __enter__(self):
    self.signal, self._old, self._alone = None, None, jax.process_count() == 1
    return self

  def arm(self) -> None:
    if self._alone and self._old is None:
      self._old = [signal.signal(s, self._handle) for s in self.SIGNALS]

  def __exit__(self, *exc):
    if self._old is not None:
      for s, old in zip(self.SIGNALS, self._old, strict=True):
        signal.signal(s, old)

  def _handle(self, signum, frame):
    self.signal = signal.Signals(signum).name

  def requested(self, step: int) -> bool:
    if not self._alone and multihost_utils.reached_preemption_sync_point(step):
      self.signal = "SIGTERM (all processes)"
    return self.signal is not None
