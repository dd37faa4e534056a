"""Where the harness's tasks and their data sets come from: the local task
folder (`--include_path`), the Hugging Face hub, the datasets cache.

A hub that cannot be reached is found in one connection attempt, before the
harness starts: the hub and datasets libraries then read from disk only
(their offline mode), so a data set that is not cached fails at once in one
line, where they would otherwise retry for tens of seconds and log each try.
"""

import contextlib
import os
import re
import socket
import sys
import urllib.parse
import urllib.request
from pathlib import Path

from loopjax.errors import ConfigError, first_line

REACH_TIMEOUT_S = 3.0  # one TCP connect to the hub; a blackholed route waits this long
_OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def _endpoint() -> tuple[str, int]:
  """(host, port) the libraries connect to for the hub (`HF_ENDPOINT`, else
  theirs): its proxy where one is set (`HTTPS_PROXY`, ...; not bypassed by
  `NO_PROXY`), since a cluster behind one reaches the hub only through it."""
  from huggingface_hub import constants

  url = urllib.parse.urlsplit(constants.ENDPOINT)
  host = url.hostname or "huggingface.co"
  proxy = urllib.request.getproxies().get(url.scheme or "https")
  if proxy and not urllib.request.proxy_bypass(host):
    url = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    host = url.hostname or host
  return host, url.port or (443 if url.scheme == "https" else 80)


def reachable(host: str, port: int, timeout: float = REACH_TIMEOUT_S) -> bool:
  """Whether a TCP connection to host:port opens within `timeout` seconds."""
  try:
    socket.create_connection((host, port), timeout=timeout).close()
  except OSError:  # no route, DNS failure, refused, timed out
    return False
  return True


def offline_unless_reachable() -> bool:
  """Puts the hub and datasets libraries in their offline mode when the hub
  cannot be reached (and it was not already asked for); returns whether
  they are offline. They read the mode from the environment at import and
  from their own constants at each call: both are set."""
  if any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in _OFFLINE):
    return True
  host, port = _endpoint()
  if reachable(host, port):
    return False
  print(
    f"loopjax: the hub ({host}:{port}) is unreachable; data sets are read from "
    "disk only (HF_HUB_OFFLINE=1)",
    file=sys.stderr,
  )
  for name in _OFFLINE:
    os.environ[name] = "1"
  from huggingface_hub import constants

  constants.HF_HUB_OFFLINE = True
  if (datasets_config := sys.modules.get("datasets.config")) is not None:
    datasets_config.HF_HUB_OFFLINE = datasets_config.HF_DATASETS_OFFLINE = True
  return True


@contextlib.contextmanager
def data_on_disk():
  """The harness run inside: a hub it cannot reach switches the libraries
  offline first, and a task's data set neither on disk nor downloadable (the
  datasets library raises ConnectionError) is one line saying what to do."""
  offline_unless_reachable()
  try:
    yield
  except ConnectionError as e:
    raise ConfigError(
      f"a task's data set is not on disk and cannot be downloaded here "
      f"({first_line(e, 160)}): download it where there is a network into "
      "HF_DATASETS_CACHE (or HF_HOME), then run with HF_DATASETS_OFFLINE=1"
    ) from None


def why_unknown(task: str, include_path: str | None) -> str:
  """Where to look: a YAML file under include_path that names the task but
  does not load (the harness skips it without a word), or what lists tasks."""
  if not include_path:
    return "`lm_eval ls tasks` lists the harness's; local YAML tasks: --include_path"
  import yaml

  for path in sorted(Path(include_path).expanduser().rglob("*.yaml")):
    text = path.read_text(errors="replace")
    if path.stem != task and not re.search(
      rf"^task:\s*['\"]?{re.escape(task)}\b", text, re.M
    ):
      continue
    try:
      yaml.safe_load(text)
    except yaml.YAMLError as e:
      return f"{path} names it but does not load: {first_line(e, 160)}"
    return f"{path} names it but the harness does not read it as a task"
  return f"no YAML file under --include_path={include_path} names it"
