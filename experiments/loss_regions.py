"""Can a loss with one device's meaning keep ZeRO's explicit collectives?

A loss means what it means on one device when it runs as plain ``jax.jit``
code over the global batch (the batch axes automatic, GSPMD's). ZeRO's
collectives can stay explicit if each parameter the loss reads is gathered
in a ``shard_map`` region of its own, whose backward reduce-scatters the
gradient. Four ways to type what the loss receives, each checked here against
``jax.grad`` on one device, for a parameter that the loss uses the ways
models do (a matmul, a slice such as ``pos_emb[:T]``, a cast to the compute
dtype, a row lookup such as an embedding):

- ``reduced``: the region's output typed *reduced* over ``data``
  (``all_gather(..., to="reduced")``, ``out_specs=P(..., reduced=...)``, on
  a mesh whose axes are Explicit inside the region), so that the cotangent
  arrives unreduced and one reduce-scatter sums it: ZeRO's bytes;
- ``replicated``: the region's output an ordinary replicated value, its
  backward a custom VJP that reduce-scatters: the compiler first all-reduces
  the cotangent (plain ``jax.jit``'s rule for a replicated value);
- ``gspmd backward``: the region's gather in forward, and a term of value
  zero whose transpose is the compiler's own (a resharding of the shard);
- ``reduced param``: no region. The whole parameter is typed reduced
  before it is differentiated (MaxText's deferred gradient all-reduce), the
  loss runs in ``jax.sharding.auto_axes``, and the unreduced gradient is
  reduce-scattered explicitly.

For each: the gradient's error relative to one device's, and the
collectives of the compiled program (for the CPU devices, or with
``--target`` for 8 compile-only GPUs), e.g.::

  python experiments/loss_regions.py
  python experiments/loss_regions.py --target h100 --out experiments/results/loss_regions_h100.md
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys

_FLAG = "--xla_force_host_platform_device_count=8"
if __name__ == "__main__" and _FLAG.split("=")[0] not in os.environ.get(
    "XLA_FLAGS", ""):
  # Before jax is imported: 8 CPU devices.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " +
                             _FLAG).strip()

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

# How the loss uses the gathered parameter ``w`` (8 elements) with the
# batch ``x`` (rows of 4): each returns a scalar.
USES = {
    "matmul": lambda w, x: jnp.sum(jnp.sin(x @ w.reshape(4, 2))),
    "slice (pos_emb[:T])": lambda w, x: jnp.sum(jnp.sin(x + w[:4])),
    "cast (astype bf16)": lambda w, x: jnp.sum(jnp.sin(
        x + w[4:].astype(jnp.bfloat16).astype(jnp.float32))),
    "row lookup (embedding)": lambda w, x: jnp.sum(jnp.sin(
        x + w.reshape(2, 4)[jnp.array([1])][0])),
    "scaled then sliced": lambda w, x: jnp.sum(jnp.sin(x + (2 * w)[:4])),
}


@jax.custom_vjp
def _gather_forward_only(shard):
  return jax.lax.all_gather(shard, "data", tiled=True, axis=0)


_gather_forward_only.defvjp(
    lambda s: (_gather_forward_only(s), None),
    lambda _, ct: (jnp.zeros((ct.shape[0] // jax.lax.axis_size("data"),) +
                             ct.shape[1:], ct.dtype),))


@jax.custom_vjp
def _gather(shard):
  return jax.lax.all_gather(shard, "data", tiled=True, axis=0)


def _gather_fwd(shard):
  return _gather(shard), None


def _gather_bwd(_, ct):
  return (jax.lax.psum_scatter(ct, "data", scatter_dimension=0,
                               tiled=True),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def region(kind: str, shard: jax.Array) -> jax.Array:
  """The whole parameter from its shard, in a region of the given kind."""
  if kind == "gspmd backward":
    # Forward: the region's gather. Backward: the compiler's own, through
    # a term that is zero in value: the resharding's transpose.
    mesh = jax.sharding.get_abstract_mesh()
    whole = jax.lax.with_sharding_constraint(
        shard, NamedSharding(mesh, P(None)))
    explicit = jax.shard_map(_gather_forward_only, mesh=mesh,
                             in_specs=P("data"), out_specs=P(None),
                             check_vma=False)(shard)
    return jax.lax.stop_gradient(explicit) + (
        whole - jax.lax.stop_gradient(whole))

  def inside(s):
    mesh = jax.sharding.get_abstract_mesh()  # the Explicit one, in here
    if kind == "reduced":
      return jax.shard_map(
          lambda s: jax.lax.all_gather(s, "data", tiled=True, axis=0,
                                       to="reduced"),
          mesh=mesh, in_specs=P("data"),
          out_specs=P(None, reduced={"data"}))(s)
    return jax.shard_map(_gather, mesh=mesh, in_specs=P("data"),
                         out_specs=P(None), check_vma=False)(s)

  return jax.sharding.explicit_axes(inside, axes="data",
                                    in_sharding=P("data"))(shard)


KINDS = ("reduced", "replicated", "gspmd backward", "reduced param")


def _typed(mesh, kind: str):
  """The mesh a kind runs under: "reduced param" needs Explicit axes."""
  if kind != "reduced param":
    return mesh
  return jax.make_mesh(mesh.devices.shape, mesh.axis_names,
                       axis_types=(AxisType.Explicit,),
                       devices=list(mesh.devices.flat))


def _collectives(text: str) -> list[str]:
  return re.findall(r"\b(all-gather|all-reduce|reduce-scatter)"
                    r"(?:-start)?\(", text)


def _reduced_param_grad(loss, w_whole, x):
  """The gradient shard of ``loss`` with respect to ``w_whole`` typed
  reduced (under an Explicit mesh context)."""
  w = jax.sharding.reshard(w_whole, P(None, reduced={"data"}))
  g = jax.grad(lambda w, x: jax.sharding.auto_axes(
      loss, axes="data", out_sharding=P())(w, x))(w, x)
  return jax.shard_map(
      lambda g: jax.lax.psum_scatter(g, "data", scatter_dimension=0,
                                     tiled=True),
      mesh=jax.sharding.get_abstract_mesh(),
      in_specs=P(None, unreduced={"data"}), out_specs=P("data"))(g)


def measure(kinds=KINDS, uses=tuple(USES), target: str | None = None
            ) -> list[dict]:
  """One row per (use, kind): the gradient's relative error against one
  device (run on this machine's devices), and the collectives of the
  program compiled for them, or, with ``target`` (``"h100"``), for 8
  compile-only GPUs of it (``zero_jax.analysis.gpu_mesh``)."""
  n = len(jax.devices("cpu"))
  mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,),
                       devices=jax.devices("cpu"))
  gpus = None
  if target:
    from zero_jax import analysis  # pylint: disable=g-import-not-at-top
    devs = analysis.gpu_devices(target, n)
    gpus = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,),
                         devices=devs)
  x = (jnp.arange(4 * n * 4, dtype=jnp.float32).reshape(4 * n, 4) / 100)
  w = jnp.linspace(0.5, 1.5, 8)
  rows = []
  for use in uses:
    loss = USES[use]
    ref = jax.grad(loss)(w, x)
    for kind in kinds:
      # (The parameter enters whole for "reduced param", else sharded.)
      w_spec = P() if kind == "reduced param" else P("data")
      if kind == "reduced param":
        grad = jax.jit(functools.partial(_reduced_param_grad, loss))
      else:
        grad = jax.jit(jax.grad(lambda s, b, loss=loss, kind=kind:
                                loss(region(kind, s), b)))
      with jax.set_mesh(_typed(mesh, kind)):
        m = _typed(mesh, kind)
        ws = jax.device_put(w, NamedSharding(m, w_spec))
        xs = jax.device_put(x, NamedSharding(m, P("data")))
        g = grad(ws, xs)
        text = grad.lower(ws, xs).compile().as_text()
      if gpus is not None:
        g_mesh = _typed(gpus, kind)
        with jax.set_mesh(g_mesh):
          shape = lambda a, spec: jax.ShapeDtypeStruct(
              a.shape, a.dtype, sharding=NamedSharding(g_mesh, spec))
          text = grad.lower(shape(w, w_spec),
                            shape(x, P("data"))).compile().as_text()
      err = float(jnp.max(jnp.abs(g - ref)) / jnp.max(jnp.abs(ref)))
      rows.append({"use": use, "kind": kind, "devices": n, "rel_err": err,
                   "ratio": float(np.max(np.abs(g)) / np.max(np.abs(ref))),
                   "collectives": _collectives(text),
                   "compiled_for": target or "cpu"})
  return rows


def table(rows: list[dict]) -> str:
  lines = [f"jax {jax.__version__}, {rows[0]['devices']} CPU devices; "
           f"collectives compiled for {rows[0]['devices']} x "
           f"{rows[0]['compiled_for']}",
           "", "| use of the gathered parameter | region output | gradient "
           "rel. error | gradient / one device's | collectives |",
           "|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['use']} | {r['kind']} | {r['rel_err']:.2g} | "
                 f"{r['ratio']:.3g} | {', '.join(r['collectives'])} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", help="also append the table to this file")
  p.add_argument("--target", default=None, choices=("h100", "h200"),
                 help="compile for 8 compile-only GPUs of this kind for the "
                 "collectives column (needs jax[cuda12]; no GPU)")
  args = p.parse_args(argv)
  text = table(measure(target=args.target))
  sys.stdout.write(text)
  if args.out:
    with open(args.out, "a") as f:
      f.write("\n" + text)


if __name__ == "__main__":
  main()
