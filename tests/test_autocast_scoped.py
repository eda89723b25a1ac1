"""autocast's scoped rules: ``rules={(primitive, pattern): rule}`` decides the equations whose
module path (their ``jax.named_scope`` names: flax linen's module path) matches ``pattern``,
so a recipe's last block and head stay in the compute dtype with no edit to the model."""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_scaler

POLICY = "p=f32,c=bf16,o=f32"
BF16_DOT = re.compile(r"bf16\[[^\]]*\] = dot_general")


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(32)(nn.relu(nn.Dense(32)(x)))


class Model(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(3):
      x = Block()(x)
    return nn.Dense(16, name="head")(x)


@pytest.fixture(scope="module")
def linen():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((32, 32)), jnp.float32)
  model = Model()
  return model, model.init(jax.random.key(0), x), x


def test_the_last_block_and_the_head_stay_in_bf16_by_a_rule_with_the_same_numerics(linen):
  model, v, x = linen
  scoped = jmp_scaler.autocast(model.apply, POLICY, rules={
    "dot_general": "nvfp4", ("dot_general", r"Block_2|head"): "compute"})
  text = str(jax.make_jaxpr(scoped)(v, x))
  every = str(jax.make_jaxpr(jmp_scaler.autocast(
    model.apply, POLICY, rules={"dot_general": "nvfp4"}))(v, x))
  assert len(BF16_DOT.findall(text)) == 3 and not BF16_DOT.findall(every)
  assert "scaled_matmul" in text

  # the same as running the blocks one by one: two in NVFP4, the third and the head in bf16
  p = v["params"]
  nv = {"dot_general": "nvfp4"}
  half = "p=f32,c=bf16,o=bf16"
  blk = lambda q, h: Block().apply({"params": q}, h)  # noqa: E731
  h = jmp_scaler.autocast(blk, half, rules=nv)(p["Block_0"], x)
  h = jmp_scaler.autocast(blk, half, rules=nv)(p["Block_1"], h)
  h = jmp_scaler.autocast(blk, half)(p["Block_2"], h)
  out = jmp_scaler.autocast(lambda q, h: nn.Dense(16).apply({"params": q}, h), POLICY)(
    p["head"], h)
  np.testing.assert_array_equal(scoped(v, x), out)

  grads = jax.grad(lambda v: jnp.sum(scoped(v, x) ** 2))(v)
  for g in jax.tree.leaves(grads):
    assert g.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(g))) and bool(jnp.any(g != 0))


def test_a_scoped_rule_may_run_another_recipe(linen):
  model, v, x = linen
  f = jmp_scaler.autocast(model.apply, POLICY, rules={
    "dot_general": "nvfp4", ("dot_general", "head"): "mxfp8"})
  text = str(jax.make_jaxpr(f)(v, x))
  assert "f4_e2m1fn" in text and "f8_e8m0fnu" in text  # NVFP4 elements, MXFP8 scales
  only_nv = str(jax.make_jaxpr(jmp_scaler.autocast(
    model.apply, POLICY, rules={"dot_general": "nvfp4"}))(v, x))
  assert "f8_e8m0fnu" not in only_nv


def test_named_scopes_compose_through_jit_and_scan():
  # a plain JAX function names its regions with jax.named_scope; the path is the scopes of
  # the calls around an equation, outermost first
  def f(w, x):
    with jax.named_scope("encoder"):
      def layer(h, wi):
        with jax.named_scope("layer"):
          return h @ wi, None
      x, _ = jax.lax.scan(layer, x, w[:2])
    with jax.named_scope("decoder"):
      x = jax.jit(lambda a, b: a @ b)(x, w[2])
    return x @ w[3]

  w = jnp.ones((4, 32, 32)) / 32
  x = jnp.ones((8, 32))
  f8 = jmp_scaler.autocast(f, POLICY, rules={
    "dot_general": "fp8", ("dot_general", r"^encoder/layer$"): "compute",
    ("dot_general", "^decoder"): "float32"})
  # the scan's dot in bf16, the jitted one in float32, the last (in no scope) in fp8
  assert _dot_operands(jax.make_jaxpr(f8)(w, x).jaxpr) == [
    ("bfloat16",) * 2, ("float32",) * 2, ("float8_e4m3fn",) * 2]
  np.testing.assert_allclose(f8(w, x), f(w, x), rtol=0.1)


def _dot_operands(jaxpr, out=None):
  """The operand dtypes of every dot_general in ``jaxpr`` and its sub-jaxprs, in order."""
  out = [] if out is None else out
  for e in jaxpr.eqns:
    if e.primitive.name == "dot_general":
      out.append(tuple(str(v.aval.dtype) for v in e.invars))
    for p in e.params.values():
      for q in p if isinstance(p, (tuple, list)) else [p]:
        sub = q if hasattr(q, "eqns") else getattr(q, "jaxpr", None)
        if hasattr(sub, "eqns"):
          _dot_operands(sub, out)
  return out


def test_a_pattern_that_matches_nothing_warns_naming_the_paths_there_are(linen):
  model, v, x = linen
  f = jmp_scaler.autocast(model.apply, POLICY, rules={
    "dot_general": "nvfp4", ("dot_general", "Blok_2"): "compute"})
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jax.make_jaxpr(f)(v, x)
  msgs = [str(w.message) for w in caught if "matched no" in str(w.message)]
  assert len(msgs) == 1
  assert "('dot_general', 'Blok_2')" in msgs[0] and "Model/Block_2/Dense_0" in msgs[0]
  assert "Model/head" in msgs[0]


@pytest.mark.parametrize("key, rule, match", [
  (("dot_general", "(unclosed"), "compute", r"not a regular expression"),
  (("dot_general",), "compute", r"\(primitive or its name, pattern\)"),
  (("dot_general", 3), "compute", r"\(primitive or its name, pattern\)"),
  (("conv_general_dilated", "head"), "nvfp4", r"rules\[\('conv_general_dilated', 'head'\)\] "
                                              r"is 'nvfp4'"),
  (("dot_generl", "head"), "compute", r"dot_general"),
  (("dot_general", "head"), "bf16", r"rules\[\('dot_general', 'head'\)\] must be one of"),
])
def test_bad_scoped_rules_raise_at_construction_naming_the_key(key, rule, match):
  with pytest.raises(ValueError, match=match):
    jmp_scaler.autocast(lambda w, x: x @ w, POLICY, rules={key: rule})


def test_a_scoped_rule_of_an_elementwise_op_leaves_the_others_as_planned():
  # autocast runs an op fed only to float32 ops (the sums) in float32; a scoped rule changes
  # the equations in its scope only
  def f(x):
    with jax.named_scope("a"):
      y = x * 3.0
    with jax.named_scope("b"):
      z = x * 5.0
    return jnp.sum(y) + jnp.sum(z)

  def mul_dtypes(fn):
    jaxpr = jax.make_jaxpr(fn)(jnp.ones((4, 4), jnp.float16)).jaxpr.eqns[0].params["jaxpr"]
    return [str(e.outvars[0].aval.dtype) for e in jaxpr.eqns if e.primitive.name == "mul"]

  assert mul_dtypes(jmp_scaler.autocast(f, "p=f32,c=f16,o=f32")) == ["float32", "float32"]
  scoped = jmp_scaler.autocast(f, "p=f32,c=f16,o=f32", rules={("mul", "^b$"): "compute"})
  assert mul_dtypes(scoped) == ["float32", "float16"]


def test_the_no_match_warning_lists_the_paths_of_its_own_primitive():
  def f(w, x):
    with jax.named_scope("proj"):
      h = x @ w
    with jax.named_scope("scale"):
      return jnp.sum(h * 2.0)

  g = jmp_scaler.autocast(f, POLICY, rules={("mul", "^proj$"): "compute",
                                            ("dot_general", "^proj$"): "float32"})
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jax.make_jaxpr(g)(jnp.ones((4, 4)), jnp.ones((2, 4)))
  msgs = [str(w.message) for w in caught if "matched no" in str(w.message)]
  assert msgs == [msgs[0]] and "('mul', '^proj$')" in msgs[0] and "['scale']" in msgs[0]
