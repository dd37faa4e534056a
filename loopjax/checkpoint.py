"""orbax checkpoints of the train state and the data iterator.

Layout: `workdir/checkpoints/<step>/{state,data,meta}`; which steps are kept
is the workdir's rule (`Workdir.checkpoints`). Saves are async. `meta` holds a
checksum of every saved array, computed on device before the write and checked
after a restore. Training restores the whole state; evaluation and every
other reader the params alone (`restore(partial=True)`): the optimizer's
moments and a grad filter's state are never read.
Restore walks back from the newest step until one restores and verifies; a step
that does not is set aside by a record, `workdir/checkpoints_damaged.json`
({step: why}), not moved (a move on a bucket is a copy per object): readers
and the keep policy pass it over, and it stays for inspection until the run
saves that step again. orbax commits each step atomically for its storage: on
a disk it writes a temporary directory and renames it; on a bucket it writes
the step in place and then its `commit_success.txt` marker, and lists only
steps with one. A kill mid-write leaves no step to restore from.
"""

import contextlib
import json
import os
import re
import time

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from loopjax import sharding, storage
from loopjax.errors import ConfigError, first_line

DAMAGED = "checkpoints_damaged.json"  # beside checkpoints/


class NoGoodCheckpoint(ConfigError):
  """Checkpoints exist but none restores; they are left as they are."""


class WriteError(OSError):
  """A checkpoint could not be written (disk full, file too large, no permission)."""


class CorruptCheckpoint(ValueError):
  """A checkpoint whose arrays do not match the checksums saved with them."""


@jax.jit
def _digest(tree):
  """Per leaf, sum_i word_i * (2i + 1) mod 2^32 over the array's 32-bit words,
  and whether every float in the tree is finite.

  Any change to one word changes the sum (2i + 1 is odd, so invertible mod 2^32);
  so do swapped words. Runs on device, sharded or not, without a host copy.
  """

  def leaf(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    x = x.ravel().astype(jnp.uint8) if x.dtype == jnp.bool_ else x.ravel()
    if x.dtype.itemsize == 4:
      w = jax.lax.bitcast_convert_type(x, jnp.uint32)
    else:  # 1- and 2-byte types: widen the bit pattern; 8-byte: x64 is off
      w = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
      w = w.astype(jnp.uint32)
    i = jnp.arange(w.size, dtype=jnp.uint32)
    return jnp.sum(w * (2 * i + 1), dtype=jnp.uint32)

  floats = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
  finite = jnp.all(jnp.stack([jnp.isfinite(x).all() for x in floats] or [True]))
  return jax.tree.map(leaf, tree), finite


def digest(tree) -> tuple[dict[str, int], bool]:
  """({leaf path: checksum}, all floats finite) for `tree` (see `_digest`)."""
  sums, finite = jax.device_get(_digest(tree))
  paths = jax.tree.leaves_with_path(sums)
  return {jax.tree_util.keystr(k): int(v) for k, v in paths}, bool(finite)


def save(mngr: ocp.CheckpointManager, step: int, state, data_iter) -> None:
  """Saves asynchronously; refuses (FloatingPointError) a state with NaN or
  inf. A step set aside as damaged is replaced (its record says so)."""
  sums, finite = digest(state)
  if not finite:
    raise FloatingPointError(f"step {step}: the train state holds NaN or inf")
  if (why := damaged(mngr.directory, cache=True).get(step)) is not None:
    _replace_damaged(mngr, step, why)
  with _writing():  # also reports the previous async save's failure, if any
    mngr.save(
      step,
      force=True,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_iter.get_state()),
        meta=ocp.args.JsonSave({"checksums": sums}),
      ),
    )


def wait(mngr: ocp.CheckpointManager) -> None:
  """Blocks until async saves are on disk; raises WriteError if one failed."""
  with _writing():
    mngr.wait_until_finished()


@contextlib.contextmanager
def _writing():
  try:
    yield
  except (OSError, ValueError) as e:  # tensorstore reports I/O errors as ValueError
    line, reason = first_line(e), _os_reason(e)
    if reason and reason not in line:
      line = f"{reason}: {line}"
    raise WriteError(f"a checkpoint write failed: {line}") from e


def _os_reason(e: BaseException) -> str:
  """The OS's words for the error ("File too large"), put before the library's.

  Tensorstore's messages can run past what first_line keeps and then carry the
  cause only as `os_error_code='27'`; the errno is looked up in the exception
  chain first, then in the message.
  """
  while e is not None:
    if isinstance(e, OSError) and e.errno:
      return os.strerror(e.errno)
    if m := re.search(r"os_error_code='?(\d+)", str(e)):
      return os.strerror(int(m.group(1)))
    e = e.__cause__ or e.__context__
  return ""


def restore(
  mngr: ocp.CheckpointManager,
  abstract_state,
  data_iter=None,
  step: int | None = None,
  quarantine: bool = True,
  partial: bool = False,
):
  """Restores `step` (default: the newest good one) -> (state, step).

  `abstract_state` gives the tree structure, shapes and dtypes; the data
  iterator, if given, is moved to its saved position. `partial`: the state
  is some of the saved state's top-level entries (evaluation's {"params":
  ...}), and only their arrays are read (`_restore_part`). Returns (None, None)
  when there is no checkpoint. A checkpoint that fails to restore or to verify
  raises if `step` was asked for. Otherwise older ones are tried, and the bad
  newer ones are set aside (`DAMAGED`) once an older one restores; steps
  already set aside are passed over. If none restores, nothing is recorded
  and NoGoodCheckpoint says why (e.g. a changed model). `quarantine=False`
  (evaluation, which may run beside a trainer) records nothing.
  """
  directory, bad_before = epath.Path(mngr.directory), damaged(mngr.directory)
  steps = sorted(mngr.all_steps(), reverse=True) if step is None else [step]
  failed = []
  for s in steps:
    if step is None and s in bad_before:
      continue
    if step is None and not (directory / str(s)).is_dir():
      continue  # deleted since the list was read (a trainer's keep policy)
    # Checkpoints written before checksums existed restore unverified.
    has_meta = (directory / str(s) / "meta").is_dir()
    items = {} if partial else {"state": ocp.args.StandardRestore(abstract_state)}
    items |= {"data": ocp.args.JsonRestore()} if data_iter is not None else {}
    items |= {"meta": ocp.args.JsonRestore()} if has_meta else {}
    try:
      out = mngr.restore(s, args=ocp.args.Composite(**items)) if items else {}
      sums = out["meta"]["checksums"] if has_meta else None
      if partial:
        state = _restore_part(directory / str(s) / "state", abstract_state)
        _check_part(state, sums, s)
      else:
        state = out["state"]
      if has_meta:
        verify(state, sums, s)
      if data_iter is not None:
        data_iter.set_state(out["data"])
    except Exception as e:  # noqa: BLE001 - any unreadable checkpoint: try older
      if step is not None:
        raise
      if _unreachable(e):  # the storage's trouble, not the step's: no verdict
        raise WriteError(f"cannot read checkpoint {s}: {damage(e)}") from e
      if not (directory / str(s)).exists():
        continue  # deleted while it was read (a trainer's keep policy)
      failed.append((s, damage(e)))
      continue
    for bad, why in failed:
      if quarantine:
        _set_aside(mngr, bad, why)
      else:
        print(f"checkpoint {bad} is damaged ({why}); left in place")
    return state, s
  if failed:
    raise NoGoodCheckpoint(
      f"no checkpoint in {mngr.directory} restores (newest, step {failed[0][0]}: "
      f"{failed[0][1]}); nothing was changed. Move them away to start afresh"
    )
  return None, None


def _restore_part(directory: epath.Path, abstract_part):
  """orbax's partial restore of the saved tree in `directory`: the arrays of
  `abstract_part` alone are read, each into its sharding; the rest (the
  optimizer's moments, a Grokfast window: 3x to 100x the params) is never
  read or held. Its own checkpointer: a manager that saved the state has
  bound the item to a handler without partial restores."""
  args = ocp.args.PyTreeRestore(
    item=abstract_part,
    restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_part),
    partial_restore=True,
  )
  reader = ocp.PyTreeCheckpointer()
  try:
    return reader.restore(directory, args=args)
  finally:
    reader.close()


def _check_part(part, checksums: dict[str, int] | None, step: int) -> None:
  """A part restored (`_restore_part`) holds exactly the saved arrays under its
  top-level entries. orbax returns a leaf the checkpoint lacks as the
  abstract one given and passes over saved leaves not asked for: either is
  another model than the one saved (ValueError, as a full restore's)."""
  mine = {jax.tree_util.keystr(k) for k, _ in jax.tree.leaves_with_path(part)}
  absent = sorted(
    jax.tree_util.keystr(k)
    for k, x in jax.tree.leaves_with_path(part)
    if not isinstance(x, jax.Array)
  )
  heads = tuple(f"[{k!r}]" for k in part)
  extra = sorted(k for k in checksums or () if k.startswith(heads) and k not in mine)
  why = [f"has no {', '.join(absent[:4])}"] if absent else []
  why += [f"holds {', '.join(extra[:4])}, which this model lacks"] if extra else []
  if why:
    raise ValueError(f"checkpoint {step} {'; '.join(why)} (another model's?)")


# What says a read failed because the storage did not answer: a status name
# (TensorStore, gRPC), an HTTP code on the exception (gcsfs, google-cloud), an
# exception type; never a number in the message (a byte count, 45034, held
# "503": a truncated step passed for a busy bucket, the run stopped).
_TRANSIENT_STATUS = re.compile(
  r"\b(UNAVAILABLE|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED)\b"
)
_TRANSIENT_HTTP = (429, 500, 502, 503, 504)
_TRANSIENT_TYPES = ("ServiceUnavailable", "TooManyRequests", "Timeout")


def _unreachable(e: BaseException) -> bool:
  """A read that failed because the storage did not answer (a bucket's 5xx,
  429, a timeout), which says nothing about the checkpoint."""
  while e is not None:
    if (
      type(e).__name__ in _TRANSIENT_TYPES
      or getattr(e, "code", None) in _TRANSIENT_HTTP
    ):
      return True
    if _TRANSIENT_STATUS.search(str(e).split("See full TensorStore")[0]):
      return True
    e = e.__cause__ or e.__context__
  return False


def damage(e: Exception) -> str:
  """What is wrong with a checkpoint, in a line: TensorStore appends a dump of
  its spec ("See full TensorStore details: <bound method ...") to the cause."""
  return first_line(e).split(" See full TensorStore details")[0].rstrip(".")


def steps(mngr: ocp.CheckpointManager, tries: int = 5) -> list[int]:
  """The complete checkpoints on disk now, oldest first, less those set
  aside. A trainer's keep policy may delete one while the list is read
  (orbax then raises FileNotFoundError): it is read again."""
  for attempt in range(tries):
    try:
      mngr.reload()
      bad = damaged(mngr.directory)
      return sorted(s for s in mngr.all_steps() if s not in bad)
    except FileNotFoundError:
      if attempt == tries - 1:
        raise
      time.sleep(0.05 * 2**attempt)


def verify(state, saved: dict[str, int], step: int) -> None:
  """Raises CorruptCheckpoint naming the arrays whose checksums differ."""
  bad = [k for k, v in digest(state)[0].items() if saved.get(k) != v]
  if bad:
    raise CorruptCheckpoint(
      f"checkpoint {step}: checksum mismatch in {', '.join(bad[:4])}"
      + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
    )


def damaged(directory, cache: bool = False) -> dict[int, str]:
  """{step: why} of the steps set aside in the run of `directory`; `cache`:
  the trainer's, which alone writes the record, read once."""
  return {int(k): v for k, v in _record(directory, cache)["damaged"].items()}


_RECORDS: dict[str, dict] = {}  # the record as this process last wrote it


def _record_path(directory) -> epath.Path:
  return epath.Path(directory).parent / DAMAGED


def _record(directory, cache: bool = True) -> dict:
  """`DAMAGED`: {"damaged": {step: why}, "replaced": {step: why}}. The
  trainer, its only writer, keeps it in memory: the keep policy reads it at
  every save."""
  if (known := _RECORDS.get(str(directory))) is not None:
    return known
  path = _record_path(directory)
  record = {"damaged": {}, "replaced": {}}
  if path.exists():
    try:
      found = json.loads(path.read_text())
      record = {k: dict(found[k]) for k in ("damaged", "replaced")}
    except (ValueError, TypeError, KeyError):
      raise ConfigError(f"{path}: not a record of damaged steps; restore it") from None
  if cache:
    _RECORDS[str(directory)] = record
  return record


def _write_record(mngr, change) -> None:
  """Process 0 rewrites the record whole with `change(record)` applied."""
  record = _record(mngr.directory)
  change(record)
  _RECORDS[str(mngr.directory)] = record
  if sharding.writes():
    storage.write_whole(_record_path(mngr.directory), json.dumps(record, indent=2))
  if jax.process_count() > 1:  # every process reads the same record after
    multihost_utils.sync_global_devices("checkpoints_damaged")


def _set_aside(mngr: ocp.CheckpointManager, step: int, why: str) -> None:
  """Records a bad step: readers and the keep policy pass it over; its bytes
  stay for inspection."""
  _write_record(mngr, lambda r: r["damaged"].update({str(step): why}))
  print(f"checkpoint {step} is damaged ({why}); set aside in {DAMAGED}")


def _replace_damaged(mngr: ocp.CheckpointManager, step: int, why: str) -> None:
  """The run has trained to a damaged step again: the bad bytes go, the
  record keeps why."""
  if step in mngr.all_steps():  # orbax's own list: set-aside steps stay in it
    mngr.delete(step)

  def replaced(record):
    record["replaced"][str(step)] = record["damaged"].pop(str(step), why)

  _write_record(mngr, replaced)


class LatestGood:
  """orbax preservation policy: the newest `n` steps not set aside, and every
  step set aside (until the run saves it again)."""

  def __init__(self, directory, n: int):
    self.directory, self.n = directory, n

  def should_preserve(self, checkpoints, *, context):
    del context
    bad = damaged(self.directory, cache=True)
    good = sorted((c.step for c in checkpoints if c.step not in bad), reverse=True)
    newest = set(good[: self.n])
    return [c.step in newest or c.step in bad for c in checkpoints]


def abstract(tree):
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
