"""Runs one loopjax command as N processes on this machine: a multi-host run
on localhost (the tests use it; so can a workstation with several GPUs).

  python launch/local.py --num_processes=2 [--devices_per_process=1] -- \\
      python -m loopjax.main --config=experiments/sysgen.py:tiny --workdir=runs/mp

Process i gets `--coordinator_address=localhost:PORT --num_processes=N
--process_id=i` appended (process 0 hosts the coordinator) and, with
--cpu (default), JAX_PLATFORMS=cpu and `devices_per_process` CPU devices. Every
output line is prefixed with `[i]`. When a process fails, the others get
SIGTERM after --grace seconds and SIGKILL after twice that (they also stop by
themselves once a collective with the dead one fails or its heartbeat is
missed); the exit code is the first failure's. With --no-cpu, process i sees
GPUs i*k .. i*k+k-1 (k = devices_per_process). --follow also starts an
evaluation job on the CPU (`--mode=eval --follow` on the command's --workdir;
its lines prefixed `[eval]`), which ends once it has evaluated the final
checkpoint, or is stopped like the others if training fails. --dry-run prints
the commands.
"""

import argparse
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launch import slurm  # noqa: E402


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def commands(cmd: list[str], n: int, port: int) -> list[list[str]]:
  return [
    [
      *cmd,
      f"--coordinator_address=localhost:{port}",
      f"--num_processes={n}",
      f"--process_id={i}",
    ]
    for i in range(n)
  ]


def _relay(name, stream) -> None:
  for line in iter(stream.readline, ""):
    sys.stdout.write(f"[{name}] {line}")
    sys.stdout.flush()


def cpu_env(environ, devices: int) -> dict:
  """`environ` for a process of `devices` CPU devices; the other XLA flags
  kept, so each process compiles what one process would (a flag that changes
  XLA:CPU's emitters changes the numbers)."""
  kept = [
    f
    for f in environ.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count=")
  ]
  flags = " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])
  return dict(environ) | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}


def main(argv=None) -> int:
  p = slurm.Parser(description=__doc__.split("\n")[0])
  p.add_argument("--num_processes", type=int, default=2)
  p.add_argument("--devices_per_process", type=int, default=1)
  p.add_argument("--cpu", action=argparse.BooleanOptionalAction, default=True)
  p.add_argument("--grace", type=float, default=10.0)
  p.add_argument("--follow", action="store_true", help="and an evaluation job")
  p.add_argument("--dry-run", action="store_true")
  p.add_argument("cmd", nargs=argparse.REMAINDER)
  args = p.parse_args(argv)
  cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
  if not cmd:
    p.error("the command to run goes after --")
  k = args.devices_per_process
  if args.cpu:
    envs = [cpu_env(os.environ, k)] * args.num_processes
  else:  # process i uses GPUs i*k .. i*k+k-1, not all of them
    envs = [
      os.environ | {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(i * k, i * k + k)))}
      for i in range(args.num_processes)
    ]
  cmds = commands(cmd, args.num_processes, free_port())
  names = list(range(args.num_processes))
  if args.follow:
    cmds.append([sys.executable, "-m", "loopjax.main", *slurm.follow_args(cmd)])
    envs.append(os.environ | {"JAX_PLATFORMS": "cpu"})
    names.append("eval")
  if args.dry_run:
    for c in cmds:
      print(shlex.join(c))
    return 0
  procs = [
    subprocess.Popen(
      c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e
    )
    for c, e in zip(cmds, envs, strict=True)
  ]
  relays = [
    threading.Thread(target=_relay, args=(i, pr.stdout), daemon=True)
    for i, pr in zip(names, procs, strict=True)
  ]
  for t in relays:
    t.start()
  trainers, failed_at = procs[: args.num_processes], None
  while any(pr.poll() is None for pr in procs):
    if failed_at is None and any(pr.poll() for pr in trainers):  # not the eval job
      failed_at = time.monotonic()
    waited = 0 if failed_at is None else time.monotonic() - failed_at
    for pr in procs if waited > args.grace else ():
      if pr.poll() is None:  # SIGTERM is a preemption to JAX; then SIGKILL
        pr.terminate() if waited < 2 * args.grace else pr.kill()
    time.sleep(0.2)
  for t in relays:
    t.join()
  return next((pr.returncode for pr in procs if pr.returncode), 0)


if __name__ == "__main__":
  sys.exit(main())
