"""Small models, optimizers and the single-device reference for tests."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

# Optimizers every stage must match exactly. Clipping at 0.1 is tight enough
# to be active, so the global norm over all shards is really exercised;
# adafactor factors every matrix with both dims >= 32. ``lr`` scales the
# learning rates: Adam-like updates normalise away gradient magnitudes, so a
# fp32 reassociation difference of 1e-7 in a small gradient becomes an update
# difference proportional to the learning rate. On the tiny GPT at lr 1e-2,
# two *single-device* runs that differ only in splitting the batch into 4
# chunks already differ by 2.8e-5; at lr 1e-3 that floor is below 1e-5.
OPTIMIZERS = {
    "adamw": lambda lr=1.0: optax.adamw(1e-2 * lr, weight_decay=0.1),
    "sgd_momentum": lambda lr=1.0: optax.sgd(1e-2 * lr, momentum=0.9),
    "lion": lambda lr=1.0: optax.lion(1e-3 * lr),
    "adafactor": lambda lr=1.0: optax.adafactor(1e-2 * lr,
                                                min_dim_size_to_factor=32),
    "clip_adam": lambda lr=1.0: optax.chain(optax.clip_by_global_norm(0.1),
                                            optax.adam(1e-2 * lr)),
}


def mlp_params(key=jax.random.PRNGKey(0)):
  k = jax.random.split(key, 3)
  return {
      "w1": jax.random.normal(k[0], (16, 64)) * 0.3,
      "b1": jnp.zeros((64,)),
      "w2": jax.random.normal(k[1], (64, 64)) * 0.15,
      "w3": jax.random.normal(k[2], (64, 8)) * 0.15,
  }


def mlp_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  h = jnp.tanh(h @ params["w2"])
  return jnp.mean((h @ params["w3"] - batch["y"]) ** 2)


def _mlp_mask(batch):
  # Rows whose first target is above 0.3: about 38% of them, unevenly over
  # the devices' slices and micro-batches.
  return (batch["y"][:, 0] > 0.3).astype(jnp.float32)


def mlp_masked_loss(params, batch):
  """``mlp_loss`` as a padded mean: over the rows ``_mlp_mask`` keeps, of
  global meaning (it is not a mean of per-device means)."""
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  h = jnp.tanh(h @ params["w2"])
  err = jnp.mean((h @ params["w3"] - batch["y"]) ** 2, -1)
  mask = _mlp_mask(batch)
  return jnp.sum(err * mask) / jnp.sum(mask)


def mlp_masked_count(batch):
  """``mlp_masked_loss``'s weight: the rows it keeps."""
  return jnp.sum(_mlp_mask(batch))


def mlp_batches(steps=10, batch=32, seed=0):
  rng = np.random.default_rng(seed)
  return [{"x": rng.normal(size=(batch, 16)).astype(np.float32),
           "y": rng.normal(size=(batch, 8)).astype(np.float32)}
          for _ in range(steps)]


def awkward_params(key=jax.random.PRNGKey(1)):
  """Leaves no device count divides, and a scalar."""
  k = jax.random.split(key, 4)
  return {
      "v7": jax.random.normal(k[0], (7,)) * 0.1,
      "m13x24": jax.random.normal(k[1], (13, 24)) * 0.1,
      "t357": jax.random.normal(k[2], (3, 5, 7)) * 0.1,
      "scalar": jnp.array(0.5),
      "w": jax.random.normal(k[3], (5, 13)) * 0.3,
  }


def awkward_loss(params, batch):
  x = batch["x"]                                     # (B, 13)
  h = jnp.tanh(x @ params["m13x24"])                 # (B, 24)
  h = h[:, :7] * params["v7"] + jnp.sum(params["t357"], axis=(0, 1))
  out = h @ params["w"][:, :7].T * params["scalar"]  # (B, 5)
  return jnp.mean((out - batch["y"]) ** 2)


def awkward_batches(steps=5, batch=16, seed=0):
  rng = np.random.default_rng(seed)
  return [{"x": rng.normal(size=(batch, 13)).astype(np.float32),
           "y": rng.normal(size=(batch, 5)).astype(np.float32)}
          for _ in range(steps)]


def _train_jit(loss_fn, tx, params, batches, params_on, batch_on):
  """Plain optax under ``jax.jit``, the parameters (and so the optimizer
  state) placed on ``params_on``, each batch on ``batch_on``."""
  params = jax.device_put(params, params_on)
  opt_state = jax.device_put(tx.init(params), params_on)

  @jax.jit
  def step(p, o, b):
    loss, g = jax.value_and_grad(loss_fn)(p, b)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, loss

  losses = []
  for b in batches:
    params, opt_state, loss = step(params, opt_state,
                                   jax.device_put(b, batch_on))
    losses.append(float(loss))
  return losses, params


def train_reference(loss_fn, tx, params, batches):
  """Plain single-device optax training on the full global batches."""
  dev = jax.devices()[0]
  return _train_jit(loss_fn, tx, params, batches, dev, dev)


def run_steps(engine, state, batches):
  """Steps ``engine`` over ``batches``: the final state and the losses."""
  losses = []
  for b in batches:
    state, metrics = engine.step(state, b)
    losses.append(float(metrics["loss"]))
  return state, losses


def train_engine(engine, params, batches):
  state, losses = run_steps(engine, engine.init(params), batches)
  return losses, engine.gather_params(state), state


def rel_err(a, b) -> float:
  """Largest per-leaf ||a - b|| / ||b||."""
  def err(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))

  errs = jax.tree.map(err, a, b)
  return max(jax.tree.leaves(errs))


def assert_matches(losses, params, ref_losses, ref_params, tol=1e-5):
  assert len(losses) == len(ref_losses)
  for i, (l, r) in enumerate(zip(losses, ref_losses)):
    assert abs(l - r) <= tol * abs(r), f"step {i}: loss {l} vs reference {r}"
  assert jax.tree.structure(params) == jax.tree.structure(ref_params)
  err = rel_err(params, ref_params)
  assert err <= tol, f"parameters differ from reference: rel err {err:.3g}"


def train_plain_jit(loss_fn, tx, params, batches, mesh):
  """Plain ``jax.jit`` (GSPMD) training on ``mesh``'s devices: each batch
  split along its first dimension over every mesh axis, the parameters
  replicated. The same sums as one device, in another order."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  auto = jax.sharding.Mesh(mesh.devices, mesh.axis_names)
  return _train_jit(loss_fn, tx, params, batches, NamedSharding(auto, P()),
                    NamedSharding(auto, P(tuple(auto.axis_names))))


def reduction_floor(loss_fn, tx, params, batches, mesh, reference) -> float:
  """How far plain ``jax.jit`` on ``mesh`` lands from single-device training
  (``reference``, from ``train_reference``): the model's own floor for
  results summed in another order, in ``assert_matches``' measure."""
  losses, out = train_plain_jit(loss_fn, tx, params, batches, mesh)
  ref_losses, ref_params = reference
  loss_err = max(abs(l - r) / abs(r) for l, r in zip(losses, ref_losses))
  return max(loss_err, rel_err(out, ref_params))


def floor_tolerance(floor: float, multiple: float = 8.0) -> float:
  """A small multiple of a measured reduction-order floor, never below
  1e-5: a wrong gather or scatter moves values by the learning rate, far
  beyond either."""
  return max(1e-5, multiple * floor)


@functools.cache
def cached_reference(model: str, opt: str):
  """Reference run per (model, optimizer), shared across stages and N."""
  loss_fn, params, batches = MODELS[model]()
  return train_reference(loss_fn, OPTIMIZERS[opt](LR_SCALE[model]), params,
                         batches)


def _mlp():
  return mlp_loss, mlp_params(), mlp_batches()


MODELS = {"mlp": _mlp}


def gpt_setup(d_model=32, n_layers=2, seq_len=16, batch=16, steps=10,
              seed=0):
  """A tiny reference GPT (Flax NNX, scanned layers) and token batches."""
  from flax import nnx

  from zero_jax.models import GPT, GPTConfig, make_loss_fn

  cfg = GPTConfig(vocab_size=64, seq_len=seq_len, d_model=d_model,
                  n_layers=n_layers, n_heads=4)
  model = GPT(cfg, rngs=nnx.Rngs(seed))
  graphdef, params = nnx.split(model, nnx.Param)
  rng = np.random.default_rng(seed)
  batches = [{"tokens": rng.integers(0, 64, size=(batch, seq_len + 1),
                                     dtype=np.int32)} for _ in range(steps)]
  return make_loss_fn(graphdef), params, batches


MODELS["gpt"] = gpt_setup
# Learning-rate scale per model (see OPTIMIZERS).
LR_SCALE = {"mlp": 1.0, "gpt": 0.1}
