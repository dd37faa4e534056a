"""loopjax: recurrent-depth transformers on synthetic knowledge graphs, in JAX."""

import os

# XLA:CPU settings chosen by measurement (docs/performance.md): YNNPACK fusions
# off, since XLA's own dot emitters train these small models ~15-25% faster.
# They only affect CPU compilation; a flag already in XLA_FLAGS wins. They must
# be set before JAX starts its backend, which importing loopjax first ensures.
# LOOPJAX_XLA_DEFAULTS=0 leaves XLA_FLAGS alone.
CPU_XLA_FLAGS = {"--xla_cpu_experimental_ynn_fusion_type": ""}


def _apply_xla_defaults() -> None:
  if os.environ.get("LOOPJAX_XLA_DEFAULTS") == "0":
    return
  flags = os.environ.get("XLA_FLAGS", "")
  extra = [f"{k}={v}" for k, v in CPU_XLA_FLAGS.items() if k not in flags]
  if extra:
    os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()


_apply_xla_defaults()
