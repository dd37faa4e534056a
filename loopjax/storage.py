"""Where a run's files live: a local disk or a bucket (`gs://`), as one path
type (`etils.epath`, as orbax uses), so every reader and writer has one code
path for both.

What differs is what each storage guarantees (docs/guarantees.md): on a disk a
rename is atomic and `flock` excludes; on a bucket one object upload is atomic,
a rename is a copy per object, an append rewrites the object, and only a
generation precondition excludes (`lease.py`). So records are written whole
(`write_whole`), logs as chunks never appended to (`metrics.py`), checkpoints
committed by orbax (a rename on a disk, a `commit_success.txt` marker on a
bucket).
"""

import contextlib
import functools
import logging
import os
import re
import tempfile
import uuid

from etils import epath

from loopjax.errors import ConfigError, first_line

BUCKET = "gs"  # the one URL scheme orbax writes arrays to (tensorstore's gcs driver)
EPATH_URLS = r"/(gs|s3|az|hf)/"  # local paths etils.epath would read as URLs
EXTRA = "pip install 'loopjax[gcs]'"


def path(value, field: str = "--workdir") -> epath.Path:
  """`value` (a local path or `gs://BUCKET/...`) as the path type every module
  uses; a URL whose scheme cannot hold checkpoints, or a gs:// URL without the
  GCS client libraries, is a ConfigError naming `field`, before anything is
  written."""
  text = os.fspath(value) if isinstance(value, os.PathLike) else str(value)
  scheme, sep, rest = text.partition("://")
  if not sep:
    if re.match(r"[A-Za-z][\w+.-]*:/", text) or re.match(EPATH_URLS, text):
      raise ConfigError(  # "gs:/b" (a URL through pathlib), or etils' "/gs/b"
        f"{field}={text}: reads as a mangled URL; use gs://BUCKET/PATH or a local path"
      )
    return epath.Path(os.path.expanduser(text))
  if scheme != BUCKET:
    raise ConfigError(
      f"{field}={text}: {scheme}:// cannot hold a run (orbax writes checkpoints "
      "to a local path or gs:// only); use gs://BUCKET/PATH or a local path"
    )
  if not rest.split("/", 1)[0]:
    raise ConfigError(f"{field}={text}: no bucket named; use gs://BUCKET/PATH")
  _client_libraries(field, text)
  return epath.Path(text)


def is_bucket(p) -> bool:
  return str(p).startswith(f"{BUCKET}://")


def write_whole(p: epath.Path, data: str | bytes) -> None:
  """A record written whole: readers (an evaluation job, another host) see the
  old one or the new one, never a part. On a bucket one upload is atomic (its
  client's errors raised as OSError, as a disk's are); on a disk a temporary
  file of its own is renamed over it (TensorBoard skips the name: no
  "tfevents" in it)."""
  data = data.encode() if isinstance(data, str) else data
  if is_bucket(p):
    try:
      p.write_bytes(data)
    except OSError:
      raise
    except Exception as e:  # noqa: BLE001 - gcsfs's HttpError, auth errors
      raise OSError(f"writing {p}: {first_line(e)}") from e
    return
  fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tmp-")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    os.replace(tmp, p)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise


def check_bucket(where: epath.Path, field: str = "--workdir", write: bool = True):
  """A bucket that does not exist, an endpoint that does not answer or
  credentials that may not list (or, with `write`, write) there, as one line
  in seconds: gcsfs would retry for a minute first. A disk path passes."""
  if not is_bucket(where):
    return
  name, prefix = key(where)
  doing = "read"
  try:
    bucket = client().bucket(name)
    next(
      iter(bucket.list_blobs(prefix=prefix, max_results=1, timeout=10, retry=None)),
      None,
    )
    if write:
      doing = "write"
      blob = bucket.blob(f"{prefix}/.write-probe-{uuid.uuid4().hex}".lstrip("/"))
      blob.upload_from_string(b"", timeout=10, retry=None)
      blob.delete(timeout=10, retry=None)
  except Exception as e:  # noqa: BLE001 - the client's errors as one line
    raise ConfigError(f"{field}={where}: cannot {doing} there ({_why(e)})") from None


def key(where) -> tuple[str, str]:
  """(bucket, object name) of a gs:// path."""
  bucket, _, name = str(where).removeprefix(f"{BUCKET}://").partition("/")
  return bucket, name.rstrip("/")


@functools.cache
def client():
  """The google-cloud-storage client (anonymous against an emulator,
  STORAGE_EMULATOR_HOST, as the tests run it)."""
  from google.cloud import storage

  if os.environ.get("STORAGE_EMULATOR_HOST"):
    from google.auth.credentials import AnonymousCredentials

    return storage.Client(credentials=AnonymousCredentials(), project="loopjax")
  return storage.Client()


def _why(e: Exception) -> str:
  """A storage client's error as a few words: 404, 403, no answer."""
  from google.api_core import exceptions as gexc
  from google.auth import exceptions as auth

  if isinstance(e, auth.DefaultCredentialsError):
    return "no credentials: gcloud auth application-default login, or a VM's"
  if isinstance(e, gexc.NotFound):
    return "no such bucket"
  if isinstance(e, gexc.Forbidden):
    return "permission denied"
  text = f"{type(e).__name__}: {e}".splitlines()[0]
  if "Connection" in text or "Timeout" in text or "Max retries" in text:
    host = os.environ.get("STORAGE_EMULATOR_HOST", "storage.googleapis.com")
    return f"no answer from {host}"
  return text[:200]


def _client_libraries(field: str, text: str) -> None:
  # gcsfs reads this at import: its zonal-bucket probe fails (and logs) per call
  os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
  # etils reads gs:// through tf.io.gfile wherever TensorFlow is installed (a
  # TPU VM's image): gcsfs, configured below and tested, everywhere
  os.environ.setdefault("EPATH_USE_TF", "false")
  try:
    import gcsfs  # noqa: F401 - epath's backend for gs://
    from google.cloud import storage  # noqa: F401 - the probes and the lease
  except ImportError:
    raise ConfigError(
      f"{field}={text}: a gs:// path needs the GCS client libraries: {EXTRA}"
    ) from None
  _configure()


@functools.cache
def _configure() -> None:
  """gcsfs as a reader beside a writer on another host needs it: listings
  never cached (a follower would never see a new checkpoint); anonymous
  against an emulator; google-auth's warning per call without a metadata
  server left out."""
  import fsspec

  options = {"use_listings_cache": False}
  if os.environ.get("STORAGE_EMULATOR_HOST"):
    options["token"] = "anon"
  for protocol in ("gs", "gcs"):
    fsspec.config.conf.setdefault(protocol, {}).update(options)
  for name in ("gcsfs", "google.auth", "google.auth._default"):
    logging.getLogger(name).setLevel(logging.ERROR)
