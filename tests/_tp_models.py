"""Two small tensor-parallel models for exactness tests on 8 CPU devices
(meshes (data 4, model 2), (data 2, model 4), (replica 2, data 2,
model 2)).

Both map tokens to next-token logits: embedding -> column-parallel Linear
(split over ``model`` by output feature) -> gelu -> row-parallel Linear
(split by input feature) + residual -> layer norm -> vocabulary-parallel
head; the loss is the mean softmax cross-entropy. Every dimension split
over ``model`` (vocab 64, hidden 128) divides by 4 and 8, and every
parameter has a dimension the model leaves whole (embed 32, which divides
by 4) or a model-split one that divides by data x model, so ZeRO can add
``data`` at every mesh above.

* NNX: ``nnx.with_partitioning`` with mesh axis names. Flax 0.12 shards a
  Variable with sharding metadata as it is created ("eager sharding"),
  which needs a mesh context; ``nnx_init()`` turns that off with
  ``nnx.use_eager_sharding(False)`` (the metadata is kept, the arrays are
  made whole on the default device), ``nnx_init(mesh=...)`` creates them
  under ``jax.set_mesh(mesh)``, placed as the metadata says.
* Linen: logical names (``nn.with_logical_partitioning``) mapped by
  ``LINEN_RULES``. Linen boxes never shard by themselves: ``linen_init()``
  returns boxed unsharded arrays, ``linen_init(mesh=...)`` the same values
  placed by Flax's recipe (``jax.eval_shape`` -> ``nn.get_partition_spec``
  -> ``nn.logical_to_mesh_sharding`` -> ``jax.jit(init,
  out_shardings=...)``). ``linen_loss`` takes the boxed tree as it is:
  ``Module.apply`` unboxes ``nn.Partitioned`` parameters itself (and the
  gradient of boxed parameters comes back boxed the same way).

Both take the batches of ``tp_batches``.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from zero_jax.layout import MODEL

VOCAB = 64
EMBED = 32
HIDDEN = 128
SEQ = 8

# Logical axis -> mesh axis. ``embed`` is named explicitly as whole; the
# column-parallel ``mlp`` and the vocabulary go to ``model``.
LINEN_RULES = (("embed", None), ("mlp", MODEL), ("vocab", MODEL))


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels).mean()


# ---------------------------------------------------------------------- NNX


class NNXModel(nnx.Module):
  """The NNX model: mesh axis names in ``nnx.with_partitioning``; the
  layer norm has no metadata (it stays whole)."""

  def __init__(self, *, rngs: nnx.Rngs):
    split = nnx.with_partitioning
    normal = nnx.initializers.normal(1.0)
    lecun = nnx.initializers.lecun_normal()
    zeros = nnx.initializers.zeros_init()
    self.embed = nnx.Embed(VOCAB, EMBED,
                           embedding_init=split(normal, (MODEL, None)),
                           rngs=rngs)
    self.up = nnx.Linear(EMBED, HIDDEN,
                         kernel_init=split(lecun, (None, MODEL)),
                         bias_init=split(zeros, (MODEL,)), rngs=rngs)
    self.down = nnx.Linear(HIDDEN, EMBED,
                           kernel_init=split(lecun, (MODEL, None)),
                           rngs=rngs)
    self.norm = nnx.LayerNorm(EMBED, rngs=rngs)
    self.head = nnx.Linear(EMBED, VOCAB,
                           kernel_init=split(lecun, (None, MODEL)),
                           bias_init=split(zeros, (MODEL,)), rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    x = x + self.down(jax.nn.gelu(self.up(x)))
    return self.head(self.norm(x))


def nnx_init(seed: int = 0, mesh: jax.sharding.Mesh | None = None):
  """The NNX model's parameters, ``nnx.split(model, nnx.Param)[1]``: an
  ``nnx.State`` whose Params carry ``out_sharding`` metadata.

  Without ``mesh``: created on the default device, whole (eager sharding
  off). With ``mesh``: created under ``jax.set_mesh(mesh)``, each Param
  placed as its metadata says; the values are the same.
  """
  if mesh is None:
    with nnx.use_eager_sharding(False):
      model = NNXModel(rngs=nnx.Rngs(seed))
  else:
    with jax.set_mesh(mesh):
      model = NNXModel(rngs=nnx.Rngs(seed))
  return nnx.split(model, nnx.Param)[1]


@functools.cache
def _nnx_graphdef():
  # The structure only: merge takes each Variable's metadata from the
  # state, so one graphdef serves parameters made either way.
  with nnx.use_eager_sharding(False):
    model = nnx.eval_shape(lambda: NNXModel(rngs=nnx.Rngs(0)))
  return nnx.split(model, nnx.Param)[0]


def nnx_loss(params, batch) -> jax.Array:
  """Mean next-token cross-entropy of the NNX model."""
  model = nnx.merge(_nnx_graphdef(), params)
  return _cross_entropy(model(batch["tokens"]), batch["labels"])


# -------------------------------------------------------------------- Linen


class LinenModel(nn.Module):
  """The Linen model: logical names, mapped to mesh axes by
  ``LINEN_RULES``."""

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    names = nn.with_logical_partitioning
    lecun = nn.initializers.lecun_normal()
    zeros = nn.initializers.zeros_init()
    x = nn.Embed(VOCAB, EMBED, embedding_init=names(
        nn.initializers.normal(1.0), ("vocab", "embed")))(tokens)
    h = nn.Dense(HIDDEN, kernel_init=names(lecun, ("embed", "mlp")),
                 bias_init=names(zeros, ("mlp",)))(x)
    x = x + nn.Dense(EMBED, kernel_init=names(lecun, ("mlp", "embed")),
                     bias_init=names(zeros, ("embed",)))(jax.nn.gelu(h))
    x = nn.LayerNorm(scale_init=names(nn.initializers.ones, ("embed",)),
                     bias_init=names(zeros, ("embed",)))(x)
    return nn.Dense(VOCAB, kernel_init=names(lecun, ("embed", "vocab")),
                    bias_init=names(zeros, ("vocab",)))(x)


LINEN_MODEL = LinenModel()


def linen_init(seed: int = 0, mesh: jax.sharding.Mesh | None = None):
  """The Linen model's ``params`` collection, each leaf boxed in
  ``nn.LogicallyPartitioned``.

  Without ``mesh``: whole arrays on the default device. With ``mesh``: the
  same values, placed by ``LINEN_RULES`` (Flax's recipe: the boxes of an
  abstract init give the shardings of a jitted one).
  """
  key = jax.random.PRNGKey(seed)
  sample = jnp.zeros((1, SEQ), jnp.int32)
  if mesh is None:
    return LINEN_MODEL.init(key, sample)["params"]
  with jax.set_mesh(mesh), nn.logical_axis_rules(LINEN_RULES):
    abstract = jax.eval_shape(LINEN_MODEL.init, key, sample)
    shardings = nn.logical_to_mesh_sharding(
        nn.get_partition_spec(abstract), mesh, LINEN_RULES)
    return jax.jit(LINEN_MODEL.init,
                   out_shardings=shardings)(key, sample)["params"]


def linen_loss(params, batch) -> jax.Array:
  """Mean next-token cross-entropy of the Linen model (``params`` boxed or
  not)."""
  logits = LINEN_MODEL.apply({"params": params}, batch["tokens"])
  return _cross_entropy(logits, batch["labels"])


# ------------------------------------------------------------------ batches


def tp_batches(steps: int = 10, batch: int = 16, seed: int = 0):
  """``steps`` deterministic batches for either model: ``tokens`` and
  their next tokens ``labels``, int32 ``(batch, SEQ)``. ``batch`` 16
  splits over every batch axis of the meshes above (at most 4 ways)."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    seq = rng.integers(0, VOCAB, size=(batch, SEQ + 1), dtype=np.int32)
    out.append({"tokens": seq[:, :-1], "labels": seq[:, 1:]})
  return out
