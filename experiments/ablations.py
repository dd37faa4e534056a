"""Architecture ablations of the looped block, with the mechanistic analyses.

One factor at a time from each task's default model: input injection (none /
add / concat+adapter), norm placement (pre / sandwich), core size L = 1, 2, 4
at equal effective depth L x R = 4, initial state (embedding / random). Every
run is then analyzed (`analyze.names`: overthinking to 16 iterations,
fixed points, attention, massive activations, logit lens) and the report
tabulates the variants (`--mode=report` on the sweep root: `ablations.md`).

Variants: `composition` (default: `sysgen.py:cpu`, 2-hop composition),
`chains` (`extrapolation.py:cpu` with fixed R = 4, trained on k <= 3 hops,
20k steps), `tiny` (smoke test).

  python launch/sweep.py --config=experiments/ablations.py --root=runs/ablations \
      --analyze --parallel=2
  python -m loopjax.main --mode=report --workdir=runs/ablations
  python launch/sweep.py --config=experiments/ablations.py:chains --sweep=chains \
      --root=runs/ablations_chains --analyze --parallel=2
"""

from experiments import extrapolation, sysgen
from loopjax.kg import spec


def get_config(variant: str = "composition"):
  if variant in ("composition", "tiny"):
    c = sysgen.get_config("cpu" if variant == "composition" else "tiny")
  elif variant == "chains":
    c = extrapolation.get_config("cpu")
    c.train.depth.dist = "fixed"  # the factors, not sampled depth, vary here
    c.model.num_loops = 4
    c.data.update(max_hops=8, train_hops=3)  # fixed R = 4 reached k = 3, not 4
    c.train.num_steps = 20_000
  else:
    raise ValueError(
      f"variant: must be one of composition, chains, tiny; got {variant!r}"
    )
  c.variant = variant
  c.analyze.names = ("overthinking", *spec.SHARED)
  c.analyze.max_depth = 16  # 4x the default R = 4: every variant's 2x and 4x R
  return c


def sweep(name: str = "factors"):
  """One change at a time from the default model (`default`). `factors`: from
  composition's (no injection; the random initial state is compared with
  injection add); `chains`: from the chains variant's (`add`)."""
  others = [
    {"model.norm_position": "sandwich"},
    {"model.num_layers": 2, "model.num_loops": 2},
    {"model.num_layers": 4, "model.num_loops": 1},
  ]
  injected = {"model.injection": "add"}  # a random start needs the input injected
  sweeps = {
    "factors": [{}, injected, {"model.injection": "concat"}, *others]
    + [{"model.init_state": "random"} | injected],
    "chains": [{}, *({"model.injection": x} for x in ("none", "concat")), *others]
    + [{"model.init_state": "random"}],
  }
  if name not in sweeps:
    raise ValueError(f"must be one of {', '.join(sweeps)}; got {name!r}")
  return sweeps[name]
