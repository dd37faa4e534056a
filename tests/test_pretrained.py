"""Pretrained Hugging Face directories against their reference implementation:
tiny random checkpoints with transformers' own outputs (tests/fixtures/hf,
made by tests/fixtures/hf/make.py), loaded without torch."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from loopjax import config as config_lib
from loopjax.errors import ConfigError
from loopjax.pretrained.load import load

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def reference(name):
  return np.load(FIXTURES / name / "reference.npz")


@pytest.mark.parametrize(
  "name", ["llama_gqa", "llama_tied", "olmo2", "llama_gqa_v5", "olmo2_v5", "llama31_v5"]
)
def test_llama_and_olmo2_match_transformers_layer_by_layer(name):
  """Grouped-query and full attention, untied and tied heads, OLMo 2's norms,
  Llama 3.1's rescaling, as transformers 4.57 and 5 save them (5: RoPE in
  rope_parameters): every layer's hidden states and the logits equal that
  version's transformers (float32)."""
  cfg, model = load(FIXTURES / name, config_lib.base().model)
  ref = reference(name)
  m = model.module()
  np.testing.assert_allclose(m(ref["ids"], None), ref["logits"], atol=1e-4)
  hidden_LBTD = np.asarray(m.trace(ref["ids"], 1)["core"]["hidden"][0])
  np.testing.assert_allclose(hidden_LBTD[:-1], ref["hidden"], atol=1e-4)
  assert (cfg.num_layers, cfg.num_loops, cfg.injection) == (3, 1, "none")


@pytest.mark.parametrize("steps", [3, 5])
def test_huginn_matches_its_reference_code(steps):
  """Huginn's layout (prelude, sandwich blocks, adapter injection, qk bias,
  interleaved RoPE, the final norm before and after the coda) at R = 3 and 5
  from a zero first state: logits and the latent state entering the coda."""
  ref = reference("huginn")
  cfg, model = load(FIXTURES / "huginn", config_lib.base().model,
                    overrides={"init_state": "zeros"})  # fmt: skip
  assert (cfg.num_prelude, cfg.num_layers, cfg.num_coda, cfg.num_loops) == (1, 2, 1, 4)
  m = model.module()
  np.testing.assert_allclose(
    m(ref["ids"], None, num_loops=steps), ref[f"logits_{steps}"], atol=1e-4
  )
  last_BTD = m.trace(ref["ids"], steps)["core"]["hidden"][-1, -1]
  np.testing.assert_allclose(m.coda_in(last_BTD), ref[f"latent_{steps}"], atol=1e-4)


def test_huginns_state_after_every_iteration_is_its_reference_codes():
  """One trace to R = 5: the state leaving each iteration (its last core
  layer's output, through the final norm as the coda sees it) equals the
  reference's latent state at R = 1, ..., 5."""
  ref = reference("huginn")
  _, model = load(FIXTURES / "huginn", config_lib.base().model,
                  overrides={"init_state": "zeros"})  # fmt: skip
  m = model.module()
  states_RBTD = m.trace(ref["ids"], 5)["core"]["hidden"][:, -1]
  np.testing.assert_allclose(m.coda_in(states_RBTD), ref["latents"], atol=1e-4)


def test_any_number_of_recurrences_up_to_a_bound_is_one_program():
  """The recurrence count as a traced argument (depth <= the bound 8): one
  compile gives Huginn's reference logits at R = 3 and at 5."""
  import jax

  ref = reference("huginn")
  _, model = load(FIXTURES / "huginn", config_lib.base().model,
                  overrides={"init_state": "zeros"})  # fmt: skip
  traces = []

  @jax.jit
  def forward(model, ids, depth):
    traces.append(depth)
    return model.module()(ids, None, num_loops=8, depth=depth)

  for steps in (3, 5):
    out = forward(model, ref["ids"], np.int32(steps))
    np.testing.assert_allclose(out, ref[f"logits_{steps}"], atol=1e-4)
  assert len(traces) == 1


# Huginn's exit criteria (their names) -> loopjax.halting's
HUGINN_EXITS = {
  "kl": "kl_reverse",
  "entropy-diff": "entropy_diff",
  "latent-diff": "latent_diff",
  "cosine": "cosine",
  "argmax-stability": "argmax",
}


@pytest.mark.parametrize(
  "theirs",
  [
    c if c in ("kl", "argmax-stability") else pytest.param(c, marks=pytest.mark.slow)
    for c in HUGINN_EXITS
  ],
)
def test_huginns_exit_criteria_decide_as_its_reference_does(theirs):
  """Each criterion, at a threshold where 8 prompts exit at different steps:
  the step each prompt's next token exits at, and the token, are the
  reference's adaptive generation's (its evaluators, run from a zero state)."""
  import jax.numpy as jnp

  from loopjax import halting

  ref = reference("huginn")
  _, model = load(FIXTURES / "huginn", config_lib.base().model,
                  overrides={"init_state": "zeros"})  # fmt: skip
  ids = jnp.asarray(ref["exit_ids"])
  threshold = float(ref[f"{theirs}_threshold"])
  rule = halting.Rule(HUGINN_EXITS[theirs], eps=threshold, patience=int(threshold),
                      start="uniform")  # fmt: skip
  logp_BV, iters_B = halting.adaptive(
    model.module(), ids, jnp.full(len(ids), ids.shape[1] - 1), rule, r_max=16
  )
  want = ref[f"{theirs}_steps"]
  assert len(set(want)) > 2
  np.testing.assert_array_equal(iters_B, want)
  np.testing.assert_array_equal(np.argmax(logp_BV, -1), ref[f"{theirs}_token"])


def test_ouro_matches_its_reference_code_at_every_step():
  """The whole stack looped, sandwich norms, the final norm after every step
  and read as is: each step's logits (the reference's exit_at_step)."""
  cfg, model = load(FIXTURES / "ouro", config_lib.base().model)
  assert (cfg.num_prelude, cfg.num_layers, cfg.num_coda, cfg.num_loops) == (0, 3, 0, 4)
  ref = reference("ouro")
  m = model.module()
  for t in range(4):
    got = m(ref["ids"], None, num_loops=t + 1)
    np.testing.assert_allclose(got, ref["logits"][t], atol=1e-4, err_msg=f"step {t}")


def test_ouros_exit_gate_exits_each_token_where_its_reference_does():
  """The cumulative exit probability against thresholds 0.3, 0.6, 0.9, per
  token: the logits at each token's exit are the reference's
  (exit_threshold), and its exit step is the one whose logits those are."""
  import jax.numpy as jnp

  from loopjax import halting

  ref = reference("ouro")
  _, model = load(FIXTURES / "ouro", config_lib.base().model)
  steps_RBTV = ref["logits"]
  for i, q in enumerate(ref["thresholds"]):
    logp_BTV, iters_BT = halting.adaptive(
      model.module(), jnp.asarray(ref["ids"]), None,
      halting.Rule("gate", threshold=float(q)), r_max=4,
    )  # fmt: skip
    want_BTV = ref[f"exit_logits_{i}"]
    dist_RBT = np.abs(steps_RBTV - want_BTV[None]).max(-1)
    np.testing.assert_array_equal(iters_BT, dist_RBT.argmin(0) + 1)
    logsm = want_BTV - np.log(np.exp(want_BTV).sum(-1, keepdims=True))
    np.testing.assert_allclose(logp_BTV, logsm, atol=1e-4)
  assert len(np.unique(iters_BT)) > 2


def test_huginns_first_state_is_its_truncated_normal():
  """std sqrt(2 / 5d) x sqrt(d), cut at 3 std; a new draw per key."""
  import jax

  cfg, model = load(FIXTURES / "huginn", config_lib.base().model)
  m = model.module()
  x = np.zeros((4, 64, cfg.d_model), np.float32)
  z = np.asarray(m.initial_state(x, jax.random.key(0)))
  std = (2 / 5) ** 0.5
  assert abs(z.std() / (0.986 * std) - 1) < 0.05  # a 3-sigma cut: 0.986 std
  assert np.abs(z).max() <= 3 * std + 1e-6
  assert not np.allclose(z, m.initial_state(x, jax.random.key(1)))


def test_bfloat16_loads_every_tensor_as_bfloat16():
  """No float32 copy of the weights: params and compute in bf16, close to the
  float32 reference."""
  import jax
  import jax.numpy as jnp

  ref = reference("llama_gqa")
  _, model = load(FIXTURES / "llama_gqa", config_lib.base().model, dtype="bfloat16")
  assert {a.dtype for a in jax.tree.leaves(model.params)} == {jnp.dtype("bfloat16")}
  logits = np.asarray(model.module()(ref["ids"], None), np.float32)
  np.testing.assert_allclose(logits, ref["logits"], atol=0.25)  # bf16: 3 digits
  assert (logits.argmax(-1) == ref["logits"].argmax(-1)).mean() > 0.9


def test_a_layer_split_is_the_same_model_once_and_a_looped_one_after():
  """prelude / core / coda = 1 / 1 / 1 at R = 1 is the feedforward model; R = 3
  applies the middle layer three times."""
  ref = reference("llama_gqa")
  cfg, model = load(FIXTURES / "llama_gqa", config_lib.base().model, split=(1, 1, 1))
  assert (cfg.num_prelude, cfg.num_layers, cfg.num_coda) == (1, 1, 1)
  np.testing.assert_allclose(model.module()(ref["ids"], None), ref["logits"], atol=1e-4)
  looped = model.module()(ref["ids"], None, num_loops=3)
  assert np.isfinite(looped).all() and not np.allclose(looped, ref["logits"], atol=1e-2)


def test_a_split_of_fewer_layers_drops_those_between_prelude_and_core():
  """1,1,0 of 3 layers: the prelude is layer 0, the core layer 2 (the one
  before the coda, as retrofitting takes TinyLlama's 4,8,4 of 22), layer 1's
  tensors are read by nothing and are no error."""
  _, model = load(FIXTURES / "llama_gqa", config_lib.base().model, split=(1, 1, 0))
  params = model.params
  q = load_file(FIXTURES / "llama_gqa" / "model.safetensors")
  for group, layer in (("prelude", 0), ("core", 2)):
    want = q[f"model.layers.{layer}.self_attn.q_proj.weight"].T.reshape(32, 4, 8)
    np.testing.assert_array_equal(params[group][0]["attn"]["wq"][...], want)
  assert "coda" not in params


def test_sharded_checkpoints_load_through_their_index(tmp_path):
  tensors = load_file(FIXTURES / "llama_gqa" / "model.safetensors")
  names = sorted(tensors)
  files = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
  shards = {files[0]: names[::2], files[1]: names[1::2]}
  for file, part in shards.items():
    save_file({n: tensors[n] for n in part}, tmp_path / file)
  index = {"weight_map": {n: f for f, part in shards.items() for n in part}}
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
  shutil.copy(FIXTURES / "llama_gqa" / "config.json", tmp_path)
  _, model = load(tmp_path, config_lib.base().model)
  ref = reference("llama_gqa")
  np.testing.assert_allclose(model.module()(ref["ids"], None), ref["logits"], atol=1e-4)
  (tmp_path / files[1]).unlink()
  with pytest.raises(ConfigError, match=f"lists {files[1]}, which is missing"):
    load(tmp_path, config_lib.base().model)


def _copy(tmp_path, edit_config=None, edit_tensors=None):
  out = tmp_path / "model"
  shutil.copytree(FIXTURES / "llama_gqa", out)
  if edit_config:
    hf = json.loads((out / "config.json").read_text())
    edit_config(hf)
    (out / "config.json").write_text(json.dumps(hf))
  if edit_tensors:
    tensors = load_file(out / "model.safetensors")
    edit_tensors(tensors)
    save_file(tensors, out / "model.safetensors")
  return out


LAYER_3_Q = "model.layers.3.self_attn.q_proj.weight"
BAD = [
  (lambda hf: hf.update(model_type="gpt2"), None, "model_type must be one of llama"),
  (lambda hf: hf.update(model_type="olmo2"), None, "must be ['Olmo2ForCausalLM']"),
  (
    lambda hf: hf.update(rope_scaling={"type": "yarn"}),
    None,
    "rope_type 'yarn' is not supported (loopjax computes 'default' and 'llama3')",
  ),
  (lambda hf: hf.update(rope_scaling={"type": "llama3"}), None, "llama3' lacks factor"),
  (
    lambda hf: hf.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
    None,
    "rope_type 'dynamic' is not supported",
  ),
  (
    lambda hf: hf.update(rope_parameters={"rope_type": "bogus"}),
    None,
    "rope_type 'bogus' is not one transformers knows",
  ),
  (
    lambda hf: hf.update(rope_parameters={"rope_theta": 1e4}),
    None,
    "rope_theta (500000.0) and rope_parameters.rope_theta (10000.0) disagree",
  ),
  (
    lambda hf: hf.update(rope_parameters={"full_attention": {"rope_theta": 5e5}}),
    None,
    "rope_parameters.full_attention is not supported",
  ),
  (
    lambda hf: hf.update(partial_rotary_factor=0.5),
    None,
    "partial_rotary_factor must be 1.0",
  ),
  (
    lambda hf: hf.update(rope_parameters=[1]),
    None,
    "rope_parameters must be an object",
  ),
  (lambda hf: hf.update(num_hidden_layers=4), None, f"tensor {LAYER_3_Q} is missing"),
  (None, lambda t: t.pop("model.norm.weight"), "tensor model.norm.weight is missing"),
  (None, lambda t: t.update(extra=np.zeros(2, np.float32)), "unexpected tensor extra"),
  (
    None,
    lambda t: t.update({"model.norm.weight": np.ones(32, np.int32)}),
    "tensor model.norm.weight is stored as int32; the model needs floating",
  ),
  (
    None,
    lambda t: t.update({"model.norm.weight": np.ones(31, np.float32)}),
    "tensor model.norm.weight has shape (31,), the config needs (32,)",
  ),
]


@pytest.mark.parametrize("edit_config, edit_tensors, message", BAD)
def test_bad_directories_name_the_field_or_tensor(
  tmp_path, edit_config, edit_tensors, message
):
  path = _copy(tmp_path, edit_config, edit_tensors)
  with pytest.raises(ConfigError, match=re.escape(message)):
    load(path, config_lib.base().model)


def test_missing_files_and_splits_that_do_not_add_up(tmp_path):
  with pytest.raises(ConfigError, match="Huginn's prelude, core and coda are its own"):
    load(FIXTURES / "huginn", config_lib.base().model, split=(1, 2, 1))
  with pytest.raises(ConfigError, match="has no config.json"):
    load(tmp_path, config_lib.base().model)
  path = _copy(tmp_path)
  with pytest.raises(ConfigError, match="must fit in the model's 3 layers"):
    load(path, config_lib.base().model, split=(1, 1, 2))
  (path / "model.safetensors").unlink()
  with pytest.raises(
    ConfigError, match="has no model.safetensors or model.safetensors.index.json"
  ):
    load(path, config_lib.base().model)


RETROFIT = ["retrofit_llama", "retrofit_olmo"]


@pytest.mark.parametrize("name", RETROFIT)
def test_retrofitted_llama_and_olmo2_match_their_reference_code(name):
  """The source's own blocks (Llama's pre-norm; OLMo 2's output norms and
  q / k norms) in Huginn's layout: the concat adapter, Wqkv split into q, k, v
  (grouped or fused), rotate-half RoPE from rope_theta (llama3-rescaled for
  the Llama), the final norm after the coda only, the untied head; logits at
  R = 3 and 5 from a zero first state (the reference's init_scale 0)."""
  ref = reference(name)
  _, model = load(FIXTURES / name, config_lib.base().model,
                  overrides={"init_state": "zeros"})  # fmt: skip
  m = model.module()
  for steps in (3, 5):
    np.testing.assert_allclose(
      m(ref["ids"], None, num_loops=steps), ref[f"logits_{steps}"], atol=1e-4
    )


def test_retrofitted_layouts_are_read_from_the_checkpoint():
  """The split and mean R from config.json (1/2/1 and 2/1/1), the block from
  the tensors (config.json does not tell Llama from OLMo), RoPE from
  rope_theta (not rope_base), the first state's std as stored (Huginn's, for
  its width) at embedding scale 1."""
  want = {
    "retrofit_llama": ((1, 2, 1, 4), "pre", False, 2, 1e4, (4.0, 1.0, 4.0, 16)),
    "retrofit_olmo": ((2, 1, 1, 4), "res_post", True, 0, 5e5, ()),
  }
  for name, (split, position, qk_norm, kv, theta, llama3) in want.items():
    cfg, _ = load(FIXTURES / name, config_lib.base().model)
    assert (cfg.num_prelude, cfg.num_layers, cfg.num_coda, cfg.num_loops) == split
    assert (cfg.norm_position, cfg.qk_norm, cfg.num_kv_heads) == (position, qk_norm, kv)
    assert (cfg.rope_theta, tuple(cfg.rope_llama3)) == (theta, llama3)
    assert (cfg.embed_scale, cfg.coda_norm, cfg.tie_embeddings) == (1.0, False, False)
    assert cfg.init_state == "trunc_normal"
    assert cfg.init_state_std == pytest.approx((2 / (5 * 5280)) ** 0.5)


def _retrofit_copy(tmp_path, name, edit_config=None, edit_tensors=None):
  out = tmp_path / name
  shutil.copytree(FIXTURES / name, out)
  if edit_config:
    hf = json.loads((out / "config.json").read_text())
    edit_config(hf)
    (out / "config.json").write_text(json.dumps(hf))
  if edit_tensors:
    tensors = load_file(out / "model.safetensors")
    edit_tensors(tensors)
    save_file(tensors, out / "model.safetensors")
  return out


def test_retrofitted_olmos_embed_init_starts_from_the_prelude_output(tmp_path):
  """OLMo's initial_state_mode "embed-init" -> init_state embedding, against
  the reference run in that mode (R = 3)."""
  ref = reference("retrofit_olmo")
  path = _retrofit_copy(
    tmp_path, "retrofit_olmo", lambda hf: hf.update(initial_state_mode="embed-init")
  )
  cfg, model = load(path, config_lib.base().model)
  assert cfg.init_state == "embedding"
  logits = model.module()(ref["ids"], None, num_loops=3)
  np.testing.assert_allclose(logits, ref["embed_init_logits_3"], atol=1e-4)


def test_a_tied_retrofitted_head_reads_the_embedding(tmp_path):
  """tie_embeddings (not the stale tie_word_embeddings) decides: tied and
  without lm_head, the model equals the untied one whose head is wte."""
  ids = reference("retrofit_llama")["ids"]
  wte = "transformer.wte.weight"
  head_is_wte = lambda t: t.update({"lm_head.weight": t[wte]})  # noqa: E731
  untied = _retrofit_copy(tmp_path / "a", "retrofit_llama", None, head_is_wte)
  tied = _retrofit_copy(
    tmp_path / "b",
    "retrofit_llama",
    lambda hf: hf.update(tie_embeddings=True, tie_word_embeddings=False),
    lambda t: t.pop("lm_head.weight"),
  )
  cfg, model = load(tied, config_lib.base().model, overrides={"init_state": "zeros"})
  assert cfg.tie_embeddings
  _, want = load(untied, config_lib.base().model, overrides={"init_state": "zeros"})
  np.testing.assert_allclose(
    model.module()(ids, None, num_loops=3), want.module()(ids, None, num_loops=3),
    atol=1e-5,
  )  # fmt: skip


BAD_RETROFIT = [
  ("retrofit_olmo", lambda hf: hf.update(initial_state_mode="skip-adapter"), None,
   "initial_state_mode must be one of random, embed-init"),
  ("retrofit_llama", lambda hf: hf.update(rope_scaling={"rope_type": "yarn"}), None,
   "rope_type 'yarn' is not supported"),
  ("retrofit_llama", lambda hf: hf.update(qk_bias=True), None, "qk_bias must be False"),
  ("retrofit_llama", lambda hf: hf.pop("rope_theta"), None,
   "rope_theta is missing, here and in rope_parameters"),
  ("retrofit_llama",
   lambda hf: hf.update(rope_parameters=hf["rope_scaling"] | {"factor": 8.0}), None,
   "rope_parameters.factor (8.0) and rope_scaling.factor (4.0) disagree"),
  ("retrofit_llama", None, (1, 2, 1), "a retrofitted model's prelude, core and coda"),
]  # fmt: skip


@pytest.mark.parametrize("name, edit_config, split, message", BAD_RETROFIT)
def test_bad_retrofitted_configs_name_the_field(
  tmp_path, name, edit_config, split, message
):
  path = _retrofit_copy(tmp_path, name, edit_config)
  with pytest.raises(ConfigError, match=re.escape(message)):
    load(path, config_lib.base().model, split=split)


# The remote-code families' config.json as transformers 5 writes it (config_v5.json
# beside the 4.57 one: rope_parameters, and no rope_scaling), and the oldest
# shapes of the same fields.
FORMATS = [
  ("ouro", "config_v5.json"),
  ("retrofit_llama", "config_v5.json"),
  ("retrofit_olmo", "config_v5.json"),
  ("huginn", None),
]


@pytest.mark.parametrize("name, v5", FORMATS)
def test_a_config_as_transformers_4_and_5_write_it_is_the_same_model(
  tmp_path, name, v5
):
  """The same weights under either version's config.json: the same model
  config (RoPE base and rescaling included) and the same logits. Huginn's
  rope_base may also appear under rope_parameters."""
  ids = reference(name)["ids"]
  new = tmp_path / name
  shutil.copytree(FIXTURES / name, new)
  hf = json.loads((new / "config.json").read_text())
  if v5:
    (new / "config.json").write_text((FIXTURES / name / v5).read_text())
    assert "rope_parameters" in json.loads((new / "config.json").read_text())
  else:
    hf["rope_parameters"] = {"rope_theta": hf["rope_base"], "rope_type": "default"}
    (new / "config.json").write_text(json.dumps(hf))
  zeros = {"init_state": "zeros"}
  cfg4, m4 = load(FIXTURES / name, config_lib.base().model, overrides=zeros)
  cfg5, m5 = load(new, config_lib.base().model, overrides=zeros)
  assert cfg5.to_dict() == cfg4.to_dict()
  np.testing.assert_array_equal(m5.module()(ids, None), m4.module()(ids, None))


def test_transformers_5s_rope_parameters_set_the_base_and_the_rescaling():
  """What 4.x's reader missed: a 5.x Llama's base 5e5 and Llama 3.1's
  rescaling live only under rope_parameters; a retrofitted Llama saved by 5.x
  keeps its llama3 rescaling there too."""
  for name, theta, llama3 in [
    ("llama_gqa_v5", 5e5, ()),
    ("llama31_v5", 5e5, (4.0, 1.0, 4.0, 16)),
    ("olmo2_v5", 5e5, ()),
  ]:
    hf = json.loads((FIXTURES / name / "config.json").read_text())
    assert "rope_theta" not in hf and "rope_scaling" not in hf
    cfg, _ = load(FIXTURES / name, config_lib.base().model)
    assert (cfg.rope_theta, tuple(cfg.rope_llama3)) == (theta, llama3)


def test_fields_left_out_take_transformers_defaults_for_the_model_type(tmp_path):
  """No rms_norm_eps: Llama's 1e-6, OLMo 2's 1e-5 (their config classes'); no
  RoPE base anywhere: 10,000."""
  for name, eps in (("llama_gqa_v5", 1e-6), ("olmo2_v5", 1e-5)):
    path = tmp_path / name
    shutil.copytree(FIXTURES / name, path)
    hf = json.loads((path / "config.json").read_text())
    del hf["rms_norm_eps"], hf["rope_parameters"]
    (path / "config.json").write_text(json.dumps(hf))
    cfg, _ = load(path, config_lib.base().model)
    assert (cfg.norm_eps, cfg.rope_theta) == (eps, 10_000.0)
