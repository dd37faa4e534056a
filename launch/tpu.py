"""Runs a loopjax command on every worker of a Cloud TPU VM slice.

  python launch/tpu.py --name=loopjax-v5e --zone=us-west4-a \\
      --accelerator=v5litepod-16 --version=v2-alpha-tpuv5-lite [--dry-run] -- \\
      --config=experiments/sysgen.py:paper --workdir=gs://BUCKET/runs/paper

Creates the slice if `gcloud ... tpu-vm describe` does not find it (reuses it
otherwise), copies this checkout's committed tree (`git archive HEAD`) to every
worker and installs it (jax[tpu] and loopjax, with pip), then runs
`python -m loopjax.main ARGS` on all workers at once (`ssh --worker=all`).
JAX finds the other workers itself on TPU VMs (loopjax.main calls
jax.distributed.initialize when TPU_WORKER_HOSTNAMES lists several). The
workdir is a bucket, `gs://BUCKET/PATH` (the slice's service account needs
object read/write there): a worker's disk goes with it at every preemption,
and all workers write one checkpoint together, process 0 the logs and the
run's lease (docs/guarantees.md). A GCS FUSE mount is not the same: its
`flock` is per host, its renames are copies. Rerunning the command after a
preemption resumes from the bucket's newest committed checkpoint. `--follow`
first starts an evaluation job (`--mode=eval --follow`, on the CPU: the TPU
chips are training's) in the background on worker 0, logging to
~/loopjax-follow.log.
--dry-run prints every gcloud command instead of running it.
"""

import argparse
import shlex
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launch import slurm  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
REMOTE_DIR = "loopjax"
TARBALL = "/tmp/loopjax-checkout.tar"  # the committed tree (git archive HEAD)


def _gcloud(args, verb: str, *rest: str) -> list[str]:
  return [
    "gcloud",
    "compute",
    "tpus",
    "tpu-vm",
    verb,
    *(rest or (args.name,)),
    f"--zone={args.zone}",
    *([f"--project={args.project}"] if args.project else []),
  ]


def plan(args, main_args: list[str]) -> list[tuple[str, list[str]]]:
  """(what, command) in order; 'create' runs only if 'describe' fails."""
  run = (
    f"cd {REMOTE_DIR} && python3 -m loopjax.main --distributed {shlex.join(main_args)}"
  )
  install = (
    f"rm -rf {REMOTE_DIR} && tar xf {Path(TARBALL).name} && cd {REMOTE_DIR} && "
    f"python3 -m pip install -q 'jax[tpu]=={version('jax')}' -e '.[gcs]' "
    "-f https://storage.googleapis.com/jax-releases/libtpu_releases.html"
  )
  follow = (
    f"cd {REMOTE_DIR} && nohup env JAX_PLATFORMS=cpu python3 -m loopjax.main "
    f"{shlex.join(slurm.follow_args(main_args))} > ~/loopjax-follow.log 2>&1 &"
  )
  return [
    ("describe", _gcloud(args, "describe") + ["--format=value(state)"]),
    (
      "create",
      _gcloud(args, "create")
      + [f"--accelerator-type={args.accelerator}", f"--version={args.version}"]
      + (["--spot"] if args.spot else []),
    ),
    (
      "pack",
      ["git", "-C", str(REPO), "archive", f"--prefix={REMOTE_DIR}/", "-o", TARBALL]
      + ["HEAD"],
    ),
    ("copy", _gcloud(args, "scp", TARBALL, f"{args.name}:~/") + ["--worker=all"]),
    ("install", _gcloud(args, "ssh") + ["--worker=all", f"--command={install}"]),
    ("follow", _gcloud(args, "ssh") + ["--worker=0", f"--command={follow}"]),
    ("run", _gcloud(args, "ssh") + ["--worker=all", f"--command={run}"]),
  ]


def parser() -> argparse.ArgumentParser:
  p = slurm.Parser(description=__doc__.split("\n")[0])
  p.add_argument("--name", required=True, help="the TPU VM slice")
  p.add_argument("--zone", required=True)
  p.add_argument("--project", default=None)
  p.add_argument("--accelerator", default="v5litepod-16")
  p.add_argument("--version", default="v2-alpha-tpuv5-lite", help="TPU VM image")
  p.add_argument("--spot", action="store_true")
  p.add_argument("--skip_install", action="store_true", help="already set up")
  p.add_argument("--follow", action="store_true", help="and an evaluation job")
  p.add_argument("--dry-run", action="store_true")
  return p


def launch(args, main_args: list[str]) -> int:
  slurm.absolute_workdir(main_args)
  steps = plan(args, main_args)
  if args.skip_install:
    steps = [s for s in steps if s[0] not in ("pack", "copy", "install")]
  if not args.follow:
    steps = [s for s in steps if s[0] != "follow"]
  if args.dry_run:
    for what, cmd in steps:
      prefix = "# if describe fails:\n" if what == "create" else ""
      print(f"{prefix}{shlex.join(cmd)}")
    return 0
  for what, cmd in steps:
    if what == "describe":
      found = subprocess.run(cmd, capture_output=True, text=True)
      exists = found.returncode == 0
      if exists and found.stdout.strip() != "READY":  # e.g. a preempted spot slice
        print(
          f"error: slice {args.name} is {found.stdout.strip() or 'not ready'}; "
          "delete it or wait, then rerun",
          file=sys.stderr,
        )
        return 1
      continue
    if what == "create" and exists:
      continue
    if (rc := subprocess.run(cmd).returncode) != 0:
      print(f"error: {what} failed: {shlex.join(cmd)}", file=sys.stderr)
      return rc
  return 0


def main(argv=None) -> int:
  return launch(*slurm.split_args(parser(), argv))


if __name__ == "__main__":
  sys.exit(main())
