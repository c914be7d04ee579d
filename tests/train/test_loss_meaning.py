"""What ``loss_fn``'s value means with ``loss_scope="per_device"``, as README
and docs/usage.md say: each device's slice is averaged, DeepSpeed's and
DDP's meaning, which is one device's loss only for an equal-weight mean of
per-example terms. (The default global loss's meaning is
test_loss_scope.py's.)

These pin the documented difference, so that the docs change with it: a
masked token mean divides each slice by its own count (NaN, and a skipped
step, where a device's rows are all padding), and an in-batch contrastive
loss sees only its own slice's negatives.
"""

import jax.numpy as jnp
import numpy as np
import optax

import zero_jax as zj

D = 8


def _params():
  rng = np.random.default_rng(0)
  return {"w": (0.3 * rng.standard_normal((D, D))).astype(np.float32)}


def masked_mean(p, batch):
  err = jnp.sum((batch["x"] @ p["w"] - batch["x"]) ** 2, -1)
  return jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"])


def contrastive(p, batch):
  a = batch["x"] @ p["w"]
  b = (batch["x"] + 0.1) @ p["w"]
  logits = a @ b.T
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, jnp.arange(logits.shape[0])).mean()


def _batch():
  rng = np.random.default_rng(1)
  mask = np.ones(32, np.float32)
  mask[:4] = 0  # the first device's 4 rows (of 8 devices) are all padding
  return {"x": rng.standard_normal((32, D)).astype(np.float32),
          "mask": mask}


def _first_step(loss_fn):
  engine = zj.Engine(loss_fn, optax.sgd(0.1),
                     zj.ZeroConfig(stage=3, loss_scope="per_device"),
                     zj.make_mesh())
  _, metrics = engine.step(engine.init(_params()), _batch())
  return metrics, float(loss_fn(_params(), _batch()))


def test_a_masked_mean_with_an_all_padding_device_is_nan_and_skipped():
  metrics, one_device = _first_step(masked_mean)
  assert np.isfinite(one_device)
  assert np.isnan(float(metrics["loss"]))
  assert bool(metrics["skipped"])


def test_a_contrastive_loss_sees_only_its_slices_negatives():
  metrics, one_device = _first_step(contrastive)
  value = float(metrics["loss"])
  assert np.isfinite(value)
  assert abs(value - one_device) > 0.05 * abs(one_device), (value,
                                                            one_device)
