"""Shared fixtures: tiny configs and a CPU with 8 devices for sharding tests."""

import atexit
import contextlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
from unittest import mock

# LLVM's optimizations off: the suite's programs are tiny, so compiling them is
# most of its time, and faster code buys nothing (one core, tests of the model,
# analysis and recurrence: 196 s -> 105 s). XLA:CPU's older fusion emitter: an
# op run outside jit compiles in ~25 ms instead of ~45 (test_analysis and a
# resume test: 50 s -> 29 s). Its transcendentals may differ in the last bits
# from the default emitter's: a test's subprocesses get these flags too
# (CPU_ENV; launch/local.py keeps them), so their numbers match in-process ones.
os.environ.setdefault(
  "XLA_FLAGS",
  "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
  " --xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false",
)
# CPU tests, whatever else is installed: the `targets` extra's libtpu and CUDA
# plugin serve compile-only topologies (tests/test_launch.py), not devices.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for this session's processes (in-process
# runs and every CLI subprocess): the suite compiles the same tiny programs
# dozens of times. Fresh per session, so nothing carries over between runs;
# a cached executable is the same program, so results are bit for bit the same.
_CACHE = tempfile.mkdtemp(prefix="loopjax-test-xla-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# Libraries' logs kept off the terminal (loopjax/liblog.py): this session's.
_LOGS = tempfile.mkdtemp(prefix="loopjax-test-logs-")
atexit.register(shutil.rmtree, _LOGS, ignore_errors=True)
os.environ.setdefault("LOOPJAX_LOG_DIR", _LOGS)

from loopjax import xla  # noqa: E402

xla.apply_defaults()  # as the entry points do: in-process runs match the CLI's

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def tiny_config(tmp_path):
  """The `tiny` sysgen variant with its dataset under this test's tmp dir."""
  from experiments import sysgen

  c = sysgen.get_config("tiny")
  c.data.data_dir = str(tmp_path / "data")
  return c


def losses(workdir):
  """{step: train/loss} from a run's records (a re-logged step: the last)."""
  from loopjax import metrics

  return {
    r["step"]: r["train/loss"] for r in metrics.read(workdir) if "train/loss" in r
  }


def steps_on_disk(workdir):
  """The complete checkpoints' steps, sorted: on a bucket, those with orbax's
  commit marker."""
  from etils import epath

  from loopjax import storage

  folder = epath.Path(str(workdir)) / "checkpoints"
  steps = [p for p in folder.iterdir() if p.name.isdigit()]
  if storage.is_bucket(folder):
    steps = [p for p in steps if (p / "commit_success.txt").exists()]
  return sorted(int(p.name) for p in steps)


@pytest.fixture(scope="session")
def gcs():
  """A GCS emulator for this test session (loopjax/bench/emulator.py), its
  environment set in this process; subprocesses take `CPU_ENV | gcs.env`."""
  from loopjax.bench import emulator

  server = emulator.Emulator()
  emulator.activate(server.env)
  yield server
  server.stop()


@pytest.fixture
def bucket(gcs) -> str:
  """gs:// of a new, empty bucket on the emulator."""
  return f"gs://{gcs.bucket()}"


def cli(workdir, data_dir, *extra, config="experiments/sysgen.py:tiny"):
  """The command line of a tiny run (`config`) in `workdir`."""
  return [
    sys.executable,
    "-m",
    "loopjax.main",
    f"--config={config}",
    f"--workdir={workdir}",
    f"--config.data.data_dir={data_dir}",
    *extra,
  ]


# loopjax subprocesses see the same 8 CPU devices as in-process runs, so a run
# resumed from the command line continues one trained in-process bit for bit.
CPU_ENV = os.environ | {"JAX_PLATFORMS": "cpu"}


def run(cmd):
  """Runs a command to completion on the CPU backend; output captured as text."""
  return subprocess.run(cmd, capture_output=True, text=True, env=CPU_ENV, timeout=300)


def start(cmd):
  """Starts a command on the CPU backend; stdout and stderr as one text pipe."""
  return subprocess.Popen(
    cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=CPU_ENV
  )


def as_ltg_writes_it(out) -> None:
  """An exported k-hop directory rewritten as LTG's create_dataset.py writes it:
  one json.dump line per file, train.json's k-hop chains typed '<k-2>hop_train'."""
  import json

  for path in out.iterdir():
    items = json.loads(path.read_text())
    if path.name == "train.json":
      for x in items:
        if x["type"] != "atomic":
          x["type"] = f"{int(x['type'].split('hop')[0]) - 2}hop_train"
    path.write_text(json.dumps(items))


def write_corpus(root, docs: int = 24, seed: int = 0):
  """A small text corpus: `docs` files of code-like lines (~2 KB each)."""
  import random

  rng = random.Random(seed)
  words = "def return self value index count total item key name data list".split()
  root.mkdir(parents=True, exist_ok=True)
  for i in range(docs):
    lines = [
      f"def {rng.choice(words)}_{i}({rng.choice(words)}):\n"
      f"    {rng.choice(words)} = {rng.choice(words)} + {rng.randint(0, 99)}\n"
      f"    return {rng.choice(words)}\n"
      for _ in range(30)
    ]
    (root / f"doc{i:03d}.py").write_text("".join(lines))
  return root


QUESTIONS = [  # lm-evaluation-harness's local tasks' documents (`write_tasks`)
  {"question": "how many apples", "choices": [" one", " two", " many"], "answer": 1},
  {"question": "the cat sat", "choices": [" on", " down"], "answer": 0},
  {"question": "one two", "choices": [" three", " four", " five"], "answer": 0},
]


def write_tasks(root):
  """lm-evaluation-harness's local task format (YAML over questions.jsonl),
  offline: toy_mc (multiple choice), toy_gen (greedy text until a newline)
  and toy_ppl (each question's rolling log-likelihood: perplexities)."""
  import json

  root.mkdir(parents=True, exist_ok=True)
  data = root / "questions.jsonl"
  data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
  source = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
  (root / "toy_mc.yaml").write_text(
    f"task: toy_mc\n{source}test_split: test\noutput_type: multiple_choice\n"
    "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
    "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
  )
  (root / "toy_gen.yaml").write_text(
    f"task: toy_gen\n{source}test_split: test\noutput_type: generate_until\n"
    "doc_to_text: '{{question}}'\ndoc_to_target: ' two'\n"
    "generation_kwargs:\n  until: [\"\\n\", 'apples']\n  max_gen_toks: 6\n"
    "  do_sample: false\nmetric_list:\n  - metric: exact_match\n"
  )
  (root / "toy_ppl.yaml").write_text(
    f"task: toy_ppl\n{source}test_split: test\noutput_type: loglikelihood_rolling\n"
    "doc_to_text: ''\ndoc_to_target: '{{question}}'\nmetric_list:\n"
    "  - metric: word_perplexity\n  - metric: bits_per_byte\n"
  )
  return root


def offline_env(root) -> dict:
  """The harness's data sets read from disk only, cached under `root`."""
  return {
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_CACHE": str(root / "datasets"),
  }


@pytest.fixture
def lm_config(tmp_path):
  """The `tiny` LM variant on a small text corpus under this test's tmp dir."""
  from experiments import lm

  c = lm.get_config("tiny")
  c.data.source = f"text:{write_corpus(tmp_path / 'corpus')}/*.py"
  c.data.data_dir = str(tmp_path / "data")
  c.data.valid_fraction = 0.2
  return c


# The command line, in this process: `python -m loopjax.main` costs a JAX start
# per case; here a case costs what the mode does before it exits.
def main_in_process(*argv, entry: str = "main") -> tuple[int, list[str]]:
  """`python -m loopjax.<entry> ARGV` as `cli.run` runs it: (exit code,
  stderr's lines). An exception other than SystemExit is the traceback a
  user would see."""
  import importlib

  from absl import flags

  from loopjax import cli

  main = importlib.import_module(f"loopjax.{entry}")
  if main.__spec__.submodule_search_locations:  # a package: `-m` runs its __main__
    main = importlib.import_module(f"loopjax.{entry}.__main__")
  FLAGS = flags.FLAGS
  for name in [n for n in FLAGS if n.startswith("config.")]:
    delattr(FLAGS, name)  # config_flags defines one flag per override
  FLAGS.unparse_flags()
  err = io.StringIO()
  argv = [f"loopjax.{entry}", *argv]
  with (
    mock.patch.object(sys, "argv", argv),  # config_flags reads its overrides there
    contextlib.redirect_stderr(err),
    contextlib.redirect_stdout(io.StringIO()),
  ):
    try:
      code = cli.ended(main.main)(cli._parse(argv)) or 0  # as cli.run ends it
    except SystemExit as e:
      code = e.code
  return code, err.getvalue().splitlines()


def in_process(cmd) -> subprocess.CompletedProcess:
  """`run(cmd)` for a `python -m loopjax.<entry> ...` command, in this process
  (`main_in_process`; stdout not kept): for the refusals checked by the dozen,
  where a process each costs a JAX start. Each entry point's own process is
  tested once (tests/test_cli.py)."""
  python, dash_m, module, *argv = map(str, cmd)
  assert (python, dash_m) == (sys.executable, "-m"), cmd
  code, lines = main_in_process(*argv, entry=module.removeprefix("loopjax."))
  return subprocess.CompletedProcess(cmd, code, "", "".join(f"{x}\n" for x in lines))
