"""The optimizer recipes of train/optim.py against updates computed by hand.

AdamW and big_vision's Adafactor are checked for two steps against numpy
formulas written out here (clipping, moments, factored second moment,
momentum, LR multipliers, weight decay in both conventions), and Adafactor
also against the big_vision-shaped optax chain; the weight decay follows the
schedule (an update at lr 0 is exactly zero).
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import lit_b16_large_batch
from configs import lit_coco
from train import config_base
from train import optim


def _params(seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  return {"img": {"conv": {"kernel": f(3, 3, 2, 4)}, "norm": {"scale": f(4)}},
          "txt": {"dense": {"kernel": f(33, 40), "bias": f(40)},
                  "emb": {"embedding": f(7, 5)}},
          "head": {"log_scale": f(), "bias": f()}}


def _grads(params, seed):
  rng = np.random.default_rng(100 + seed)
  return jax.tree.map(
      lambda p: jnp.asarray(rng.normal(size=p.shape) * 3, jnp.float32), params)


def _np(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def _flat(tree):
  return {optim.path_name(p): v for p, v in
          jax.tree_util.tree_flatten_with_path(tree)[0]}


def _run(opt, params, steps=2, keys=None):
  """The updates of ``steps`` steps (params updated in between), on the
  sub-tree ``keys`` of the params (gradients drawn for the whole tree)."""
  pick = lambda tree: {k: tree[k] for k in (keys or tree)}
  params = pick(params)
  state = opt.init(params)
  out = []
  for t in range(steps):
    updates, state = opt.update(pick(_grads(_params(), t)), state, params)
    out.append(updates)
    params = optax.apply_updates(params, updates)
  return out


def _reference(params, *, direction, schedule, lr, wd, scale, clip, mults):
  """Hand-computed updates of two steps (trainable leaves; img frozen)."""
  p = {k: v for k, v in _flat(_np(params)).items() if not k.startswith("img/")}
  state = {}
  out = []
  for t in range(2):
    g = {k: v for k, v in _flat(_np(_grads(params, t))).items()
         if not k.startswith("img/")}
    norm = np.sqrt(sum(np.sum(x * x) for x in g.values()))
    g = {k: x * min(1.0, clip / norm) for k, x in g.items()}
    d = direction(g, state, t)
    lr_t = float(schedule(t))
    upd = {}
    for k in p:
      decay = wd * p[k] if p[k].ndim >= 2 else 0.0
      m = mults.get(k, 1.0)
      if scale == "lr":
        upd[k] = -lr_t * (m * d[k] + decay)
      else:
        upd[k] = -(lr_t / lr) * (lr * m * d[k] + decay)
    out.append(upd)
    p = {k: p[k] + upd[k] for k in p}
  return out


def _adam(b1, b2, eps):
  def direction(g, state, t):
    out = {}
    for k, x in g.items():
      m, v = state.get(k, (0.0, 0.0))
      m = b1 * m + (1 - b1) * x
      v = b2 * v + (1 - b2) * x * x
      state[k] = (m, v)
      mh, vh = m / (1 - b1 ** (t + 1)), v / (1 - b2 ** (t + 1))
      out[k] = mh / (np.sqrt(vh) + eps)
    return out
  return direction


def _adafactor(b1, b2_cap, decay_rate=0.8, min_dim=32, eps=1e-30):
  """big_vision's Adafactor by hand: factored RMS, then momentum (no debias,
  no parameter-scale multiplication, no update clipping)."""
  def direction(g, state, t):
    beta2 = min(b2_cap, 1.0 - (t + 1.0) ** (-decay_rate))
    out = {}
    for k, x in g.items():
      sq = x * x + eps
      if x.ndim >= 2 and sorted(x.shape)[-2] >= min_dim:
        r0, c0, mom = state.get(k, (0.0, 0.0, 0.0))
        r = beta2 * r0 + (1 - beta2) * sq.mean(axis=1)   # per row
        c = beta2 * c0 + (1 - beta2) * sq.mean(axis=0)   # per column
        u = x / np.sqrt(np.outer(r, c) / r.mean())
        state[k] = (r, c, b1 * mom + (1 - b1) * u)
      else:
        v0, _, mom = state.get(k, (0.0, None, 0.0))
        v = beta2 * v0 + (1 - beta2) * sq
        u = x / np.sqrt(v)
        state[k] = (v, None, b1 * mom + (1 - b1) * u)
      out[k] = state[k][2]
    return out
  return direction


def _assert_updates(got, want, rtol=2e-5):
  for step, (g, w) in enumerate(zip(got, want)):
    g = _flat(g)
    for k, x in g.items():
      if k.startswith("img/"):
        assert not np.any(np.asarray(x)), f"frozen {k} moved at step {step}"
        continue
      # float32 against float64: where decay and step nearly cancel, only the
      # leaf's scale bounds the rounding error.
      np.testing.assert_allclose(np.asarray(x, np.float64), w[k], rtol=rtol,
                                 atol=1e-6 * np.max(np.abs(w[k])) + 1e-12,
                                 err_msg=f"{k} step {step}")


@pytest.mark.parametrize("scale", ["lr", "schedule"])
@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_two_steps_equal_the_hand_computed_update(name, scale):
  params = _params()
  lr, wd, clip = 0.05, 0.3, 2.0
  schedule = optim.make_schedule(lr=lr, total_steps=10, warmup_steps=0)
  mults = {"head/log_scale": 0.1, "txt/dense/bias": 3.0}
  opt = optim.make_optimizer(
      name=name, schedule=schedule, lr=lr, weight_decay=wd,
      weight_decay_scale=scale, b1=0.9, b2=0.95, eps=1e-7,
      grad_clip_norm=clip, lr_mults=(("head/log_scale", 0.1),
                                     (r"txt/dense/b.*", 3.0)),
      params=params, image_locked=True)
  direction = (_adam(0.9, 0.95, 1e-7) if name == "adamw"
               else _adafactor(0.9, 0.95))
  want = _reference(params, direction=direction, schedule=schedule, lr=lr,
                    wd=wd, scale=scale, clip=clip, mults=mults)
  _assert_updates(_run(opt, params), want)


def test_adafactor_is_the_big_vision_chain():
  """The same two steps as big_vision's optax.make builds them: clip,
  scale_by_adafactor, scale(lr), decayed weights, scale_by_schedule, -1."""
  params = _params(1)
  lr, wd = 1e-3, 1e-4
  schedule = optim.make_schedule(lr=lr, total_steps=20, warmup_steps=3)
  relative = lambda t: schedule(t) / lr

  def beta2(step, exponent):
    return jnp.minimum(0.999, 1.0 - (jnp.asarray(step, jnp.float32) + 1.0)
                       ** (-exponent))
  chain = optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.scale_by_factored_rms(decay_rate=0.8, min_dim_size_to_factor=32,
                                  epsilon=1e-30, decay_rate_fn=beta2),
      optax.ema(0.9, debias=False, accumulator_dtype=jnp.bfloat16),
      optax.scale(lr),
      optax.add_decayed_weights(wd, lambda p: jax.tree.map(
          lambda x: x.ndim >= 2, p)),
      optax.scale_by_schedule(relative), optax.scale(-1.0))
  want = _run(chain, params, steps=3, keys=("txt", "head"))
  opt = optim.make_optimizer(
      name="adafactor", schedule=schedule, lr=lr, weight_decay=wd,
      weight_decay_scale="schedule", b1=0.9, b2=0.999, grad_clip_norm=1.0,
      momentum_dtype="bfloat16", params=params, image_locked=True)
  got = _run(opt, params, steps=3)
  for g, w in zip(got, want):
    for k in ("txt", "head"):
      for a, b in zip(jax.tree.leaves(g[k]), jax.tree.leaves(w[k])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6,
                                   atol=1e-12)


@pytest.mark.parametrize("scale", ["lr", "schedule"])
@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_weight_decay_follows_the_schedule(name, scale):
  """Zero gradients leave the decay alone: -lr(t) wd p ("lr") or
  -(lr(t)/lr) wd p ("schedule"); at lr(0) = 0 nothing moves at all."""
  params = _params(2)
  lr, wd = 0.02, 0.5
  schedule = optim.make_schedule(lr=lr, total_steps=10, warmup_steps=4)
  opt = optim.make_optimizer(name=name, schedule=schedule, lr=lr,
                             weight_decay=wd, weight_decay_scale=scale,
                             params=params, image_locked=False)
  zeros = jax.tree.map(jnp.zeros_like, params)
  state = opt.init(params)
  for t in range(4):
    updates, state = opt.update(zeros, state, params)
    factor = float(schedule(t)) * (1.0 if scale == "lr" else 1.0 / lr)
    for k, u in _flat(updates).items():
      p = np.asarray(_flat(params)[k])
      want = -factor * wd * p if p.ndim >= 2 else np.zeros_like(p)
      np.testing.assert_allclose(np.asarray(u), want, rtol=1e-6, atol=0)
      if t == 0:  # lr(0) = 0: exactly no change (decay included).
        assert not np.any(np.asarray(u)), k


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_zero_learning_rate_never_moves_the_params(name):
  params = _params(3)
  schedule = optax.constant_schedule(0.0)
  opt = optim.make_optimizer(name=name, schedule=schedule, lr=0.0,
                             weight_decay=1e-4, params=params,
                             image_locked=True)
  for updates in _run(opt, params, steps=2):
    assert not any(np.any(np.asarray(u)) for u in jax.tree.leaves(updates))


def test_frozen_tower_has_no_optimizer_state_and_bad_names_fail():
  params = _params()
  schedule = optim.make_schedule(lr=1e-2, total_steps=3, warmup_steps=0)
  opt = optim.make_optimizer(name="adafactor", schedule=schedule,
                             weight_decay=1e-3, params=params,
                             image_locked=True)
  inner = opt.init(params).inner_states
  assert set(inner) == {"train", "frozen"}
  assert not jax.tree.leaves(inner["frozen"])
  with pytest.raises(ValueError, match="adamw.*adafactor"):
    optim.make_optimizer(name="sgd", schedule=schedule, params=params,
                         image_locked=True)
  with pytest.raises(ValueError, match="weight_decay_scale"):
    optim.make_optimizer(name="adamw", schedule=schedule, params=params,
                         image_locked=True, weight_decay_scale="both")


def test_lr_multiplier_errors_are_one_line():
  params = _params()
  schedule = optim.make_schedule(lr=1e-2, total_steps=3, warmup_steps=0)
  for rules, message in [
      ((("hed/.*", 0.5),), "'hed/.*' matches no trainable parameter"),
      ((("img/.*", 0.5),), "matches no trainable"),  # Locked: not trainable.
      ((("head/bias", 0.0),), "must be > 0"),
      ((("head/(", 2.0),), "bad regex"),
      ((("head/bias",),), "pair")]:
    with pytest.raises(ValueError, match=message) as e:
      optim.make_optimizer(name="adamw", schedule=schedule, params=params,
                           image_locked=True, lr_mults=rules)
    assert "\n" not in str(e.value)
  mults = optim.lr_multipliers(params, (("head/.*", 0.1), (".*bias", 2.0)))
  assert mults["head/bias"] == 0.1 and mults["txt/dense/bias"] == 2.0
  assert mults["txt/dense/kernel"] == 1.0


def test_batch_larger_than_the_split_warns():
  line = optim.batch_repeat_warning(262_144, 82_783, "train")
  assert line.startswith("[lit] warning: config.batch_size=262144")
  assert "82783" in line and "\n" not in line
  assert optim.batch_repeat_warning(4096, 82_783, "train") is None
  assert optim.batch_repeat_warning(4096, None, "train") is None


def test_configs_build_their_optimizer():
  """The shipped recipes pass the config check and build (on tiny params)."""
  params = _params()
  for config in (lit_coco.get_config(), lit_b16_large_batch.get_config()):
    config_base.check_config(config)
    opt, schedule = optim.from_config(config.optim, total_steps=100,
                                      params=params, image_locked=True)
    assert float(schedule(0)) == 0.0
    _run(opt, params, steps=1)
  c = lit_b16_large_batch.get_config()
  assert (c.optim.name, c.optim.b1, c.optim.b2, c.optim.weight_decay_scale,
          c.optim.momentum_dtype) == ("adafactor", 0.9, 0.95, "schedule",
                                      "bfloat16")


@pytest.mark.parametrize("key,value,message", [
    ("weight_decay_scale", "torch", "weight_decay_scale must be"),
    ("b2", 1.0, "b2=1.0 must be in"),
    ("lr", float("nan"), "lr=nan must be a finite"),
    ("lr_mults", (("head/.*",),), "lr_mults\\[0\\]"),
    ("momentum_dtype", "float16", "momentum_dtype must be"),
])
def test_config_check_of_optim_keys(key, value, message):
  c = config_base.base_config()
  c.optim[key] = value
  with pytest.raises(ValueError, match=message):
    config_base.check_config(c)
