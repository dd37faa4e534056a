"""Submits a loopjax run to SLURM from launch/slurm.sbatch.

  python launch/slurm.py --nodes=2 --gpus_per_node=8 [--per=gpu|node] \\
      [--time=24:00:00] [--setup='source .venv/bin/activate'] [--dry-run] -- \\
      --config=experiments/sysgen.py:paper --workdir=/shared/runs/paper
  # or a bucket, which outlives the cluster's disks (pip install 'loopjax[gcs]'):
  #   ... -- --config=experiments/sysgen.py:paper --workdir=gs://BUCKET/runs/paper

`--per=gpu` (default) runs one process per GPU (nodes x gpus_per_node
processes, one GPU each); `--per=node` one process per node seeing all its
GPUs. `--follow` also runs an evaluation job (`--mode=eval --follow` on the
same workdir) as an overlapping job step on the CPUs of the first node, so
training keeps every GPU. The arguments after `--` go to
`python -m loopjax.main`. The script is written to
`<log_dir>/<job_name>.sbatch` and submitted with `sbatch`; --dry-run prints it
and the sbatch command instead.
"""

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

TEMPLATE = Path(__file__).with_name("slurm.sbatch")
REPO = Path(__file__).resolve().parents[1]


def render(args, main_args: list[str]) -> str:
  per_gpu = args.per == "gpu"
  return TEMPLATE.read_text().format(
    job_name=args.job_name,
    nodes=args.nodes,
    tasks_per_node=args.gpus_per_node if per_gpu else 1,
    gpus_per_node=args.gpus_per_node,
    gpus_per_task=1 if per_gpu else args.gpus_per_node,
    cpus_per_task=args.cpus_per_task,
    time=args.time,
    log_dir=args.log_dir,
    extra_sbatch="\n".join(f"#SBATCH {x}" for x in args.sbatch),
    repo=shlex.quote(str(REPO)),
    setup=args.setup,
    args=shlex.join(main_args),
    local_device_ids=",".join(map(str, range(1 if per_gpu else args.gpus_per_node))),
    follow=_follow_step(args, main_args) if args.follow else "",
  )


def _follow_step(args, main_args: list[str]) -> str:
  return (
    "# The evaluation job: one task on the first node's CPUs, beside training.\n"
    f"srun --overlap --nodes=1 --ntasks=1 --gpus=0 --cpus-per-task={args.cpus_per_task}"
    " --export=ALL,JAX_PLATFORMS=cpu \\\n"
    f"    python -m loopjax.main {shlex.join(follow_args(main_args))} &"
  )


class Parser(argparse.ArgumentParser):
  """argparse with its errors in one line and exit 2, as every loopjax entry
  point reports a bad argument (not the usage block above it)."""

  def error(self, message):
    print(f"error: {self.prog}: {message}", file=sys.stderr)
    sys.exit(2)


def parser() -> argparse.ArgumentParser:
  p = Parser(description=__doc__.split("\n")[0])
  p.add_argument("--nodes", type=int, default=1)
  p.add_argument("--gpus_per_node", type=int, default=8)
  p.add_argument("--per", choices=("gpu", "node"), default="gpu")
  p.add_argument("--cpus_per_task", type=int, default=8)
  p.add_argument("--time", default="24:00:00")
  p.add_argument("--job_name", default="loopjax")
  p.add_argument("--log_dir", default="slurm_logs")
  p.add_argument("--setup", default="source .venv/bin/activate")
  p.add_argument("--sbatch", action="append", default=[], help="extra #SBATCH line")
  p.add_argument("--follow", action="store_true", help="and an evaluation job")
  p.add_argument("--dry-run", action="store_true")
  return p


def absolute_workdir(main_args: list[str]) -> None:
  """Remote runs need a --workdir every host sees the same: a bucket
  (gs://BUCKET/PATH) or an absolute path on a filesystem every host mounts (a
  relative one would land in, and be deleted with, the installed checkout)."""
  workdir = [a.split("=", 1)[1] for a in main_args if a.startswith("--workdir=")]
  if not workdir or not workdir[-1].startswith(("/", "gs://")):
    sys.exit(
      "error: --workdir: must be gs://BUCKET/PATH or an absolute path on a "
      f"filesystem every host mounts; got {workdir[-1] if workdir else 'none'}"
    )


def follow_args(main_args: list[str]) -> list[str]:
  """loopjax.main's arguments for the evaluation job beside a training run: the
  trainer's workdir and config flags (its num_steps says when the run ends)."""
  keep = [a for a in main_args if a.startswith(("--config", "--workdir="))]
  if not any(a.startswith("--workdir=") for a in keep):
    sys.exit("error: --follow: the command needs a --workdir=")
  return ["--mode=eval", "--follow", *keep]


def submit(args, main_args: list[str]) -> int:
  absolute_workdir(main_args)
  script = render(args, main_args)
  path = Path(args.log_dir) / f"{args.job_name}.sbatch"
  cmd = ["sbatch", str(path)]
  if args.dry_run:
    print(f"# {path}\n{script}\n{shlex.join(cmd)}")
    return 0
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(script)
  return subprocess.run(cmd).returncode


def split_args(p: argparse.ArgumentParser, argv=None):
  """(the launcher's parsed flags, loopjax.main's arguments after `--`)."""
  argv = sys.argv[1:] if argv is None else argv
  cut = argv.index("--") if "--" in argv else len(argv)
  args = p.parse_args(argv[:cut])
  if not argv[cut + 1 :]:
    p.error("loopjax.main's arguments go after --")
  return args, argv[cut + 1 :]


def main(argv=None) -> int:
  return submit(*split_args(parser(), argv))


if __name__ == "__main__":
  sys.exit(main())
