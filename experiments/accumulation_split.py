"""Which losses split into micro-batches, and by how much the others miss.

With ``ZeroConfig(loss_scope="global")`` and ``grad_accum_steps > 1`` the
engine trains the whole batch's loss from micro-batches weighed by
``Engine(loss_weight=)`` (or equally), and its first step refuses a loss
whose weighed combination differs from the whole batch's by more than
1e-5 relative (docs/usage.md, "Over micro-batches"). This measures that
gap, in float32 on one device, for losses written as users write them:

- a padded token mean ``sum(err * mask) / sum(mask)`` (uneven valid rows,
  some micro-batches all padding);
- an in-batch contrastive loss (InfoNCE, every other row a negative);
- a reconstruction mean plus Switch's load-balancing term (batch means);
- the reference GPT's padded token mean;

each weighed by the micro-batches' valid counts and weighing the same.
The micro-batches are cut as the engine cuts them: micro-batch ``i`` is the
``i``-th block of rows of each of ``--devices`` devices' slices. The gap is
the largest over ``--batches`` random batches::

  python experiments/accumulation_split.py
  python experiments/accumulation_split.py --out experiments/results/accumulation_split_cpu.md
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

BATCH, D, H, E = 32, 16, 32, 4


def _hidden(p, x):
  return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]


def masked_mean(p, b):
  err = jnp.sum((_hidden(p, b["x"]) - b["x"]) ** 2, -1)
  return jnp.sum(err * b["mask"]) / jnp.sum(b["mask"])


def contrastive(p, b):
  a = _hidden(p, b["x"])
  v = _hidden(p, b["x"] + 0.1 * b["noise"])
  a = a / jnp.linalg.norm(a, axis=-1, keepdims=True)
  v = v / jnp.linalg.norm(v, axis=-1, keepdims=True)
  logits = a @ v.T / 0.5
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, jnp.arange(logits.shape[0])).mean()


def balanced(p, b):
  probs = jax.nn.softmax(b["x"] @ p["router"], axis=-1)
  chosen = jax.nn.one_hot(jnp.argmax(probs, -1), E)
  frac = jnp.mean(chosen, axis=0)
  balance = E * jnp.sum(frac * jnp.mean(probs, axis=0))
  gate = jnp.sum(probs * chosen, -1, keepdims=True)
  err = jnp.mean(jnp.sum((gate * _hidden(p, b["x"]) - b["x"]) ** 2, -1))
  return err + 0.1 * balance


def _mlp(rng):
  params = {"w1": 0.3 * rng.standard_normal((D, H)),
            "b1": 0.1 * rng.standard_normal((H,)),
            "w2": 0.3 * rng.standard_normal((H, D)),
            "router": 0.3 * rng.standard_normal((D, E))}

  def batch():
    mask = (rng.random(BATCH) < 0.5).astype(np.float32)
    mask[:8] = 0
    mask[-1] = 1
    return {"x": rng.standard_normal((BATCH, D)),
            "noise": rng.standard_normal((BATCH, D)), "mask": mask}

  return params, batch


def _gpt(rng):
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from zero_jax.models import GPT, GPTConfig  # pylint: disable=g-import-not-at-top

  cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layers=2,
                  n_heads=4)
  graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)

  def loss(p, b):
    tokens = b["tokens"]
    ce = optax.softmax_cross_entropy_with_integer_labels(
        nnx.merge(graphdef, p)(tokens[:, :-1]), tokens[:, 1:])
    return jnp.sum(ce * b["mask"]) / jnp.sum(b["mask"])

  def batch():
    lengths = rng.integers(0, cfg.seq_len + 1, size=BATCH)
    lengths[:8] = 0
    lengths[-1] = cfg.seq_len
    return {"tokens": rng.integers(0, 64, (BATCH, cfg.seq_len + 1)),
            "mask": (np.arange(cfg.seq_len)[None] <
                     lengths[:, None]).astype(np.float32)}

  return loss, params, batch


def cut(batch, devices: int, steps: int, i: int):
  """Micro-batch ``i``: the ``i``-th block of each device's rows."""
  return jax.tree.map(
      lambda x: x.reshape(devices, steps, -1, *x.shape[1:])[:, i].reshape(
          -1, *x.shape[1:]), batch)


def gap(loss, params, batch, devices, steps, weighed) -> float:
  """|whole - weighed combination| / |whole|, in float32."""
  as32 = lambda t: jax.tree.map(  # noqa: E731
      lambda x: jnp.asarray(x, jnp.float32)
      if np.issubdtype(np.asarray(x).dtype, np.floating) else jnp.asarray(x),
      t)
  params, batch = as32(params), as32(batch)
  whole = float(jax.jit(loss)(params, batch))
  parts = [cut(batch, devices, steps, i) for i in range(steps)]
  w = np.array([float(b["mask"].sum()) if weighed else 1.0 for b in parts])
  values = np.array([float(jax.jit(loss)(params, b)) for b in parts])
  combined = np.sum(np.where(w > 0, w * np.nan_to_num(values), 0)) / w.sum()
  return abs(whole - combined) / abs(whole)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--steps", type=int, default=2,
                  help="micro-batches (grad_accum_steps)")
  ap.add_argument("--batches", type=int, default=4)
  ap.add_argument("--out", help="also write the table (markdown) here")
  args = ap.parse_args(argv)
  rng = np.random.default_rng(0)
  params, mlp_batch = _mlp(rng)
  gpt_loss, gpt_params, gpt_batch = _gpt(rng)
  cases = [("padded token mean", masked_mean, params, mlp_batch),
           ("in-batch contrastive", contrastive, params, mlp_batch),
           ("mean + Switch balancing", balanced, params, mlp_batch),
           ("reference GPT, padded token mean", gpt_loss, gpt_params,
            gpt_batch)]
  lines = [
      f"Relative gap between the whole batch's loss and its "
      f"{args.steps} micro-batches' weighed one (float32, one device; "
      f"micro-batches cut over {args.devices} devices' slices; the largest "
      f"of {args.batches} batches). The engine refuses a gap over 1e-5.",
      "", "| loss | weighed by valid count | weighing the same |",
      "|---|---|---|"]
  for name, loss, p, make in cases:
    batches = [make() for _ in range(args.batches)]
    row = [max(gap(loss, p, b, args.devices, args.steps, weighed)
               for b in batches) for weighed in (True, False)]
    lines.append(f"| {name} | {row[0]:.1e} | {row[1]:.1e} |")
  text = "\n".join(lines) + "\n"
  sys.stdout.write(text)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      f.write("# Which losses split into micro-batches\n\n"
              "`python experiments/accumulation_split.py --out "
              f"{args.out}`\n\n" + text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
