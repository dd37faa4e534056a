"""Shared fixtures: tiny configs and a CPU with 8 devices for sharding tests."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

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
