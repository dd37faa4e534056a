"""Config defaults and validation.

Experiment files under `experiments/` start from `base()` and set what their
paper's hyperparameter table says. `validate` runs before anything compiles and
raises `ConfigError` with one line naming the field and what is allowed; each
field is checked once: a field alone by its table (field_rules.py), one a task
family reads by the family's rules (its spec.py: kg/, lm/), the fields that depend on
each other here (what only the data or the devices can tell is checked where
they are loaded: the family's `load`, `sharding.run_mesh`).
"""

import json

import ml_collections

from loopjax import config_checks, field_rules, task
from loopjax.errors import ConfigError
from loopjax.names import HALTING_LTG


def base() -> ml_collections.ConfigDict:
  """Every field loopjax reads, with defaults; experiments override them."""
  c = ml_collections.ConfigDict()
  c.seed = 0

  c.data = dict(
    # KG tasks: "generate" or "grokked_json:DIR" (the papers' files); lm:
    # "stdlib", "text:GLOB" or "tfds:NAME[:CONFIG]" (data/corpus.py)
    source="generate",
    task="composition",  # or "chains" (k-hop, depth extrapolation), "lm"
    data_dir="~/loopjax_data",  # where TFDS datasets are prepared
    num_entities=50,
    num_relations=40,
    # composition
    out_degree=20,
    ood_ratio=0.2,  # fraction of atomic facts that are OOD
    p_test_id=0.1,  # ID-ID inferred facts held out for test_inferred_id
    phi=12.0,  # inferred facts per ID atomic fact in the training set
    probe_size=300,  # examples per probe split (at most)
    # chains: k = 2..max_hops generated, k <= train_hops trained on
    max_hops=8,
    train_hops=4,
    train_per_hop=2000,
    test_per_hop=200,
    val_per_hop=0,  # held-out chains per k (none trained on) to tune halting on
    # where the answer is read: 0, at the chain's last token (position k); P,
    # every chain padded to P tokens and read at column P - 1, a pad (LTG's
    # code: 50 and 49), so the reading position tells nothing of k
    pad_to=0,
    atomic_repeat=1,  # copies of each atomic fact per epoch (1 = the paper)
    seed=0,
    # lm (data/lm.py): a BPE of vocab_size trained on the corpus, or a
    # tokenizer.json; sequences of seq_len tokens; a share of the documents
    # held out; validation on the first valid_sequences of them (0: all);
    # align: every row starts at <bos> (data/lm.py)
    vocab_size=4096,
    tokenizer="",
    seq_len=256,
    bos=True,
    align=False,
    text_field="text",
    # prompts:FILE as JSONL: the gold answer's field (GSM8K's "answer"); then
    # --mode=analyze also answers each prompt (analyze.answer_tokens, greedy)
    answer_field="",
    valid_fraction=0.02,
    valid_sequences=0,
  )

  c.model = dict(
    d_model=64,
    num_heads=4,
    num_kv_heads=0,  # grouped-query attention: 0 = num_heads
    mlp_type="gelu",  # or "swiglu" (no biases)
    mlp_ratio=4,
    mlp_hidden=0,  # the MLP's width; 0: mlp_ratio * d_model
    num_prelude=0,
    num_layers=1,  # L: layers in the shared core
    num_loops=4,  # R: iterations of the core
    num_coda=0,
    pos_encoding="learned",
    rope_theta=10_000.0,
    rope_pairing="half",  # dimensions rotated together: (i, i + H/2) or (2i, 2i+1)
    # Llama 3.1's RoPE rescaling (Llama 3.2, retrofitted from it): (factor,
    # low_freq_factor, high_freq_factor, original context length); (): none
    rope_llama3=(),
    # Randomized positions (Ruoss et al. 2023), knowledge-graph tasks with
    # rope: 0 = positions 0..T-1; P = each sequence's T positions drawn
    # without replacement from [0, P) and sorted, in training and evaluation,
    # so longer chains keep relative offsets seen in training.
    random_positions=0,
    embed_scale=1.0,  # token embeddings x this (Huginn: sqrt(d_model))
    injection="none",
    norm_position="pre",
    norm_type="layernorm",
    norm_eps=1e-5,
    state_norm=False,  # the final norm on the state after each iteration (Ouro)
    exit_gate=False,  # Ouro's exit gate, read from its checkpoint (not trained here)
    qk_norm=False,  # normalize queries and keys before RoPE (OLMo 2)
    init_state="embedding",
    init_state_std=1.0,  # "trunc_normal": N(0, std^2) cut at 3 std (Huginn)
    coda_norm=False,  # the final norm also on the state entering the coda (Huginn)
    init_std=0.02,  # projections (and an untied unembedding, the concat adapter)
    embed_init_std=0.02,  # token and learned position embeddings
    out_init_scale=1.0,  # attention and MLP output projections x this (0: zero)
    tie_embeddings=True,
    # A pretrained model (loopjax/pretrained): a local Hugging Face directory
    # whose config.json sets every shape field above; hf_split "p,c,k" places a
    # feedforward model's layers as prelude, core and coda. hf_dir: analyzed or
    # sampled as it is; init_from "hf:DIR": a training run starts from DIR's
    # Llama or OLMo 2, which also sets data.tokenizer and data.vocab_size
    # (pretrained/init_from.py).
    hf_dir="",
    hf_split="",
    init_from="",
    remat="none",
    # Attention's kernel (model/attention_kernels.py): auto = by the compile
    # target (cpu blocked, tpu splash, gpu cudnn or triton), or one by name:
    # xla, blocked, splash, triton, cudnn.
    attention="auto",
    # Packed documents attend within themselves; False: across the window, as
    # GPT-2-style trainers let them (no per-document mask: cuDNN's kernel).
    document_mask=True,
    scan_unroll=8,  # iterations unrolled per scan step (see recurrence.py)
    # Iterations past a sampled depth (train.depth): skip | mask | auto (skip
    # on CPU, mask on TPU and GPU; recurrence.py says why).
    past_depth="auto",
    dtype="float32",
  )

  c.train = dict(
    batch_size=256,
    num_steps=4000,
    lr=2e-3,
    warmup_steps=100,
    schedule="constant",
    decay_steps=0,  # cosine: optimizer steps from warmup's end to 0; 0: to num_steps
    weight_decay=0.3,
    b1=0.9,
    b2=0.98,
    eps=1e-8,  # Adam's
    decay="matrices",  # which parameters weight decay applies to: or "all"
    grad_clip=1.0,
    label_smoothing=0.0,
    z_loss=0.0,  # lm: z * logsumexp(logits)^2 per token
    # Grokking accelerators (grad_filters.py): Grokfast's low-pass filter of
    # the gradient added back (kind "ema": decay alpha; "ma": the mean of the
    # last `window`; times lamb), perp-Grad (the gradient's component along
    # each weight removed), and StableMax in place of softmax in the answer's
    # cross-entropy (xent "stablemax", loss.py). The filter's state is
    # float32 whatever the params' dtype ("params": theirs).
    grokfast=dict(kind="none", alpha=0.98, lamb=2.0, window=100, state_dtype="float32"),
    perp_grad=False,
    xent="softmax",
    supervise="last",  # iterations with a loss (train.supervised)
    # Iterations per batch: "fixed" = model.num_loops; else sampled per batch,
    # clipped to [min, max] (recurrence.sample_depth); evals use model.num_loops.
    depth=dict(dist="fixed", mean=4.0, min=2, max=8, sigma=0.5),
    backprop_depth=0,  # > 0: backprop through the last k iterations only
    # chains: train on hops <= stage, from `start`; advance when test_k<stage>
    # accuracy (at model.num_loops) >= threshold (> if strict), up to
    # data.train_hops. Per stage: optionally a fresh optimizer (and so a fresh
    # warmup: the schedule counts the optimizer's steps), and the lr times
    # lr_decay per stage passed, not below lr_min. In the last stage
    # (data.train_hops) the lr also goes by a cosine from 1x to last_stage_lr x
    # over last_stage_steps steps (0: last_stage_lr x at once), then stays.
    curriculum=dict(
      enabled=False,
      start=2,
      threshold=0.95,
      strict=False,
      reset_optimizer=False,
      lr_decay=1.0,
      lr_min=0.0,
      last_stage_lr=1.0,
      last_stage_steps=0,
    ),
    # > 0: an EMA of the params at this decay, min(d, (1 + step) / (10 + step)),
    # kept, checkpointed and evaluated beside them (metrics ema/..., loopjax/ema.py)
    param_ema=0.0,
  )

  # Grokking phase thresholds (loopjax/kg/grokking.py): accuracy on
  # train_inferred, test_inferred_id and test_inferred_ood.
  c.phases = dict(memorize=0.99, id=0.9, ood=0.9)
  # depths: () = train R only. Chains beyond the trained hops are reported
  # three ways (kg/depth.py): at extrapolation_depth iterations, fixed before
  # training (0: model.num_loops); halting on LTG's KL + entropy rule, its
  # thresholds tuned on the val_k splits of the trained depths (the grids)
  # where data.val_per_hop holds some, else eps and tau; at the best depth
  # evaluated (an oracle: chosen on the test chains).
  c.eval = dict(
    batch_size=1024,
    depths=(),
    extrapolation_depth=0,
    halting=dict(
      r_min=2,
      r_max=16,
      eps=1e-3,  # LTG's inference script: eps 1e-3, tau 3, up to 16 iterations
      tau=3.0,
      eps_grid=(1e-4, 1e-3, 1e-2, 1e-1, 0.5),
      tau_grid=(0.1, 0.3, 1.0, 3.0),
    ),
  )
  # The device mesh (sizes of data, fsdp, tensor; -1: the remaining devices)
  # and which mesh axes each logical axis name is split over (sharding.py).
  # devices: how many of this host's devices to use (0 = all).
  c.mesh = dict(data=-1, fsdp=1, tensor=1, devices=0)
  c.sharding = dict(
    rules=(
      ("batch", ("data", "fsdp")),
      ("vocab", "tensor"),
      ("embed", "fsdp"),
      ("heads", "tensor"),
      ("kv", None),
      ("mlp", "tensor"),
    )
  )
  # `--mode=analyze`: overthinking curves to max_depth iterations; the halting
  # table over each criterion's thresholds (eps: KL / latent change, tau:
  # entropy in nats, patience: argmax streak), up to r_max iterations.
  # The mechanistic analyses (logit_lens, fixed_points, attention, activations)
  # trace every layer to max_depth iterations, batch_size examples at a time;
  # Fixed points (decided per token, fixed_points.py): tol, the relative change
  # of the read state under which a token has converged; fp_share, the share of
  # tokens that must have for a layer to; cycle_margin, how far apart the
  # layers' limit directions must stay for a cyclic fixed point.
  # lens_phases: the logit lens also runs on each grokking phase's checkpoint.
  # A language model (lm/spec.ANALYSES): the first lm_windows validation windows;
  # sink_threshold, the attention mass on the first token that makes a sink.
  c.analyze = dict(
    names=(),  # (): the task family's (task.FAMILIES)
    max_depth=64,
    batch_size=256,
    tol=1e-3,
    fp_share=0.9,
    cycle_margin=0.01,
    lm_windows=32,
    sink_threshold=0.3,
    lens_phases=True,
    # A pretrained model's (model.hf_dir) feedforward baseline: a Llama or
    # OLMo 2 directory whose stages are analyzed on the same prompts.
    baseline_dir="",
    answer_tokens=256,  # new tokens per answer (data.answer_field)
    halting=dict(
      criteria=HALTING_LTG,
      r_min=2,  # LTG: iteration t against t - 1 from the second iteration on
      r_max=16,
      eps=(1e-4, 1e-3, 1e-2, 1e-1, 0.5),
      tau=3.0,  # kl_entropy's entropy bound
      tau_len=12.0,  # kl_entropy_len's: tau + tau_len / seq_len
      seq_len=50,  # LTG pads every sequence to 50 tokens; 0: the batch's length
      tau_grid=(0.1, 0.3, 1.0, 3.0),  # entropy-only thresholds
      patience=(1, 2, 4),
      gate=(0.5, 0.7, 0.9),  # an exit gate's cumulative-probability thresholds
      start="readout",  # what iteration 1 is compared with (HALTING_START)
    ),
  )
  # fork_from "DIR:STEP" (or "DIR": its newest): a new workdir starts from that
  # run's checkpoint (weights, optimizer, curriculum stage, data position) and
  # trains on under this config, which may differ from DIR's in train.* only;
  # DIR is only read (fork.py). lease_s: on a gs:// workdir, seconds
  # without renewal after which another trainer may take the run's lease
  # over (its holder was killed or preempted; lease.py).
  c.checkpoint = dict(
    every=1000, keep=3, keep_every=0, async_save=True, fork_from="", lease_s=120.0
  )
  c.eval_every = 250  # 0: no in-loop evaluation (an evaluation job follows the run)
  c.log_every = 50
  # XLA's compiled programs, kept across restarts and shared by a run's
  # processes: "" is $XDG_CACHE_HOME/loopjax/xla (~/.cache), "off" keeps none.
  c.compile_cache = ""
  return c


def analyses(c) -> tuple[str, ...]:
  """`analyze.names`, or the task family's analyses where it is empty."""
  return tuple(c.analyze.names) or task.spec(c.data.task).default_analyses


def _family_has(c, rules: task.Spec, part: str, field: str, what: str):
  """`rules`' `part`; a ConfigError naming `field` where the family has none."""
  if not getattr(rules, part):
    having = [repr(n) for n in task.FAMILIES if getattr(task.spec(n), part)]
    raise ConfigError(
      f"{field}: needs data.task {' or '.join(having)} ({what}); got task "
      f"{c.data.task!r}"
    )
  return getattr(rules, part)


def validate(c: ml_collections.ConfigDict) -> None:
  """Raises ConfigError naming the first bad field."""
  check_types(c)
  field_rules.check_fields(c)
  d, m, t, a = c.data, c.model, c.train, c.analyze
  for field, value in (
    ("data.data_dir", d.data_dir),
    ("model.hf_dir", m.hf_dir),
    ("model.init_from", m.init_from.removeprefix("hf:")),
    ("analyze.baseline_dir", a.baseline_dir),
  ):
    if "://" in value:  # a URL would become a local folder named "gs:"
      raise ConfigError(
        f"{field}: must be a local path (data sets and pretrained directories "
        f"are read from each host's disk; only --workdir may be gs://); got {value!r}"
      )
  rules = task.spec(d.task)
  if m.init_from:
    _family_has(c, rules, "init_from", "model.init_from", "a pretrained model")(c)
  elif m.hf_split and not m.hf_dir:
    raise ConfigError(
      "model.hf_split: needs model.init_from or model.hf_dir (the pretrained "
      f"model whose layers it places); got {m.hf_split!r}"
    )
  if m.exit_gate and not m.hf_dir:
    raise ConfigError(
      "model.exit_gate: a pretrained model's (Ouro's, model.hf_dir sets it); "
      "loopjax trains no exit gate"
    )
  if a.baseline_dir and not m.hf_dir:
    raise ConfigError(
      "analyze.baseline_dir: a pretrained model's baseline; needs model.hf_dir"
    )
  if m.hf_dir or d.source.startswith("prompts:"):
    field = "model.hf_dir" if m.hf_dir else "data.source"
    _family_has(c, rules, "pretrained", field, "pretrained models")(c)
  else:
    rules.check(c)
  if t.curriculum.enabled:
    _family_has(c, rules, "curriculum", "train.curriculum.enabled", "a hop curriculum")
  allowed = rules.analyses
  if wrong := [n for n in a.names if not isinstance(n, str) or n not in allowed]:
    raise ConfigError(
      f"analyze.names: each must be one of {', '.join(allowed)} (data.task "
      f"{d.task!r}); got {wrong[0]!r}"
    )
  config_checks.model(m)
  if t.depth.dist != "fixed":
    if not 1 <= t.depth.min <= t.depth.max:
      raise ConfigError(
        f"train.depth.min: must be >= 1 and <= train.depth.max ({t.depth.max}); "
        f"got {t.depth.min}"
      )
    field_rules.check(c, field_rules.DEPTH_BOUNDS)
  if t.backprop_depth > 0 and m.injection == "none":
    raise ConfigError(
      "train.backprop_depth: needs model.injection add or concat (else the "
      "embeddings get no gradient through the core); got injection 'none'"
    )
  shared = [n for n in analyses(c) if rules.analyses[n].shared]
  if a.max_depth < 2 and shared:
    raise ConfigError(
      f"analyze.max_depth: must be >= 2 for {', '.join(shared)} (they compare "
      f"successive iterations); got {a.max_depth}"
    )
  if a.halting.r_min > a.halting.r_max:
    raise ConfigError(
      f"analyze.halting.r_min: must be <= analyze.halting.r_max "
      f"({a.halting.r_max}); got {a.halting.r_min}"
    )
  depths = c.eval.depths
  if not isinstance(depths, tuple | list) or not all(
    isinstance(r, int)
    and not isinstance(r, bool)
    and 1 <= r <= field_rules.MAX_ITERATIONS
    for r in depths
  ):
    raise ConfigError(
      f"eval.depths: a tuple of integers in [1, {field_rules.MAX_ITERATIONS}], "
      f"e.g. '(4,8,16)'; got {depths!r}"
    )
  config_checks.mesh(c)


def check_types(c) -> None:
  """Raises ConfigError naming the first field whose value is not of its
  default's type (`config_checks.types`); `c`: a config, or a dict as config.json
  holds it."""
  config_checks.types(c, base())


def to_json(c: ml_collections.ConfigDict) -> str:
  return json.dumps(c.to_dict(), indent=2, sort_keys=True, default=list)
