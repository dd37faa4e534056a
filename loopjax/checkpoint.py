"""orbax checkpoints of the train state and the data iterator.

Layout: `workdir/checkpoints/<step>/{state,data}`. Saves are async; the last
`keep` are kept, plus every step divisible by `keep_every` and the steps the
training loop pins (grokking phase transitions). Restore walks back from the
newest step until one restores, so a save cut short by a kill never blocks a
resume.
"""

import logging

import jax
import orbax.checkpoint as ocp


class _Pinned:
  """Preserves the steps that are values of a dict the training loop updates."""

  def __init__(self, pinned: dict):
    self.pinned = pinned

  def should_preserve(self, checkpoints, *, context):
    del context
    steps = set(self.pinned.values())
    return [c.step in steps for c in checkpoints]


def manager(workdir, cfg, pinned: dict | None = None) -> ocp.CheckpointManager:
  """Keeps the last `cfg.keep`, every `cfg.keep_every`-th and `pinned`'s steps."""
  cm = ocp.checkpoint_managers
  policies = [cm.LatestN(n=cfg.keep), _Pinned({} if pinned is None else pinned)]
  if cfg.keep_every:
    policies.append(cm.EveryNSteps(interval_steps=cfg.keep_every))
  options = ocp.CheckpointManagerOptions(
    preservation_policy=cm.AnyPreservationPolicy(policies),
    enable_async_checkpointing=cfg.async_save,
    create=True,
  )
  return ocp.CheckpointManager((workdir / "checkpoints").absolute(), options=options)


def save(mngr: ocp.CheckpointManager, step: int, state, data_iter) -> None:
  mngr.save(
    step,
    force=True,
    args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_iter.get_state())
    ),
  )


def restore(
  mngr: ocp.CheckpointManager, abstract_state, data_iter=None, step: int | None = None
):
  """Restores `step` (default: the newest that restores) -> (state, step).

  `abstract_state` gives the tree structure, shapes and dtypes; the data
  iterator, if given, is moved to its saved position. Returns (None, None)
  when there is no checkpoint.
  """
  steps = sorted(mngr.all_steps(), reverse=True) if step is None else [step]
  for s in steps:
    try:
      out = mngr.restore(
        s,
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
        ),
      )
    except Exception as e:  # noqa: BLE001 - any unreadable checkpoint: try older
      if step is not None:
        raise
      logging.warning("checkpoint %d does not restore (%s); trying older", s, e)
      continue
    if data_iter is not None:
      data_iter.set_state(out.data)
    return out.state, s
  return None, None


def abstract(tree):
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
