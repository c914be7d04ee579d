"""Reading a checkpoint back: orbax's restore into the target layout, the
checksums verified, and, when the bytes are wrong, an error that names the
step, the leaf, the file and the newest intact step."""

from __future__ import annotations

import json
import os
from typing import Any, Callable
import warnings

from etils import epath
import orbax.checkpoint as ocp

from zero_jax.checkpoint import _integrity
from zero_jax.checkpoint._errors import CheckpointCorruptError
from zero_jax.checkpoint._matching import check_matches
from zero_jax.checkpoint._stored import STORED, ls_dict, names, stored_tree
from zero_jax.train import LossScaleState, TrainState


class Reader:
  """Reads the checkpoints of one directory for ``Checkpointer``.

  Args:
    manager: orbax's ``CheckpointManager`` of the directory.
    directory: the directory as the user named it (for messages).
    root: its path.
    kept: the committed steps, oldest first.
  """

  def __init__(self, manager: ocp.CheckpointManager, directory: str,
               root: epath.Path, kept: Callable[[], list[int]]):
    self._manager = manager
    self.directory = directory
    self._root = root
    self._kept = kept

  def _step_path(self, step: int) -> epath.Path:
    return self._root / str(step)

  def read(self, step: int, target: TrainState, explain: bool = True
            ) -> tuple[TrainState, dict[str, Any]]:
    """The checkpoint of ``step`` read into ``target``'s layout, unchecked,
    and its metadata. (``explain``: a read error becomes the
    ``CheckpointCorruptError`` that looks for an intact step.)"""
    try:
      stored, has_scale = self._stored_metadata(step)
    except ValueError as e:
      if not explain or e.__cause__ is None:
        raise
      raise self._corrupt(step, target, [], e.__cause__) from e.__cause__
    tree = {k: getattr(target, k) for k in STORED}
    meta = self.meta(step)
    for part in STORED:
      check_matches(tree[part], stored.get(part), part, self.where(step),
                    meta)
    items = {"state": ocp.args.StandardRestore(tree)}
    # A run resumed from a checkpoint without a loss scale (or skip count)
    # starts a fresh one.
    if target.loss_scale is not None and has_scale:
      items["loss_scale"] = ocp.args.StandardRestore(
          ls_dict(target.loss_scale))
    try:
      r = self._manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # orbax raises many types; say which checkpoint
      if "tree structures do not match" in str(e):
        # A difference the checks above missed is still not corruption.
        raise ValueError(
            f"{self.where(step)} does not match this model and optimizer "
            f"({e}); restore with the model and optimizer it was saved with "
            "(the stage, mesh and offload may differ)") from e
      if not explain:
        raise
      raise self._corrupt(step, target, [], e) from e
    # (Whether the stored scale is a loss scale for this engine, or only a
    # skip count to carry into a fresh one, is the engine's to decide.)
    loss_scale = (LossScaleState(**r["loss_scale"]) if "loss_scale" in items
                  else None)
    return TrainState(**r["state"], loss_scale=loss_scale), meta

  def verify(self, step: int, meta: dict[str, Any], state: TrainState,
              target: TrainState) -> None:
    """Raises ``CheckpointCorruptError`` unless the restored arrays have
    the checksums recorded at save."""
    recorded = meta.get("checksums")
    if meta.get("checksum") != _integrity.ALGORITHM or not recorded:
      warnings.warn(
          f"{self.where(step)} has no checksums (saved by an older "
          "zero_jax): restored without verifying its bytes", UserWarning,
          stacklevel=3)
      return
    found = _integrity.checksums(stored_tree(state))
    if state.loss_scale is None:  # (not restored: nothing to compare)
      recorded = {k: v for k, v in recorded.items()
                  if not k.startswith("loss_scale.")}
    bad = _integrity.mismatches(recorded, found)
    if bad:
      raise self._corrupt(step, target, bad, None)

  def _corrupt(self, step: int, target: TrainState, leaves: list[str],
               cause: Exception | None) -> CheckpointCorruptError:
    """The error for a checkpoint whose bytes are wrong (``leaves``: those
    whose checksum differs) or that orbax could not decode (``cause``)."""
    if cause is not None:
      # (Tensorstore names the key it failed on: "params.w/0.0".)
      text = str(cause)
      leaves = sorted({f"{item}.{name}" for item, names in
                       names(target).items() for name in names
                       if f"/{item}/" in text and f"{name}/" in text})
    files = []
    for leaf in leaves:
      item, name = leaf.split(".", 1)
      item_dir = str(self._step_path(step) / item)
      found = _integrity.stored_files(item_dir, name)
      files += ([os.path.join(item_dir, f) for f in found] or [item_dir])
    files = sorted(set(files))
    intact = self._newest_intact(step, target)
    text = str(cause)
    text = text if len(text) < 400 else text[:400] + " ..."
    what = (f"{type(cause).__name__}: {text}" if cause is not None else
            "the checksums recorded at save differ from the bytes read")
    where = (f"; leaves {', '.join(leaves)} in {', '.join(files)}"
             if leaves else f" (files under {str(self._step_path(step))!r})")
    offer = (f"restore step {intact}, the newest intact one: "
             f"restore(engine, params, step={intact})" if intact is not None
             else f"no earlier kept step restores intact (kept: "
             f"{self._kept()}): restore from a copy, or start over")
    return CheckpointCorruptError(
        f"{self.where(step)} is corrupt ({what}){where}. Its bytes "
        f"changed on disk after they were saved; {offer}.",
        step, leaves, files, intact)

  def _newest_intact(self, step: int, target: TrainState) -> int | None:
    """The newest kept step below ``step`` that restores with its
    checksums (read in full: this runs only when a checkpoint is
    corrupt)."""
    for t in reversed([t for t in self._kept() if t < step]):
      try:
        state, meta = self.read(t, target, explain=False)
        if meta.get("checksums"):
          found = _integrity.checksums(stored_tree(state))
          recorded = {k: v for k, v in meta["checksums"].items()
                      if state.loss_scale is not None or
                      not k.startswith("loss_scale.")}
          if _integrity.mismatches(recorded, found):
            continue
        return t
      except Exception:  # pylint: disable=broad-except
        continue
    return None

  def where(self, step: int) -> str:
    return f"checkpoint of step {step} in {self.directory!r}"

  def _unreadable(self, step: int, e: Exception) -> ValueError:
    return ValueError(
        f"could not read {self.where(step)} ({type(e).__name__}: {e}); it "
        "is corrupt or not a zero_jax checkpoint: restore an earlier one "
        f"with step= (kept: {self._kept()})")

  def _stored_metadata(self, step: int) -> tuple[dict[str, Any], bool]:
    """The stored state's tree of array metadata, and whether the
    checkpoint has a loss scale."""
    try:
      items = self._manager.item_metadata(step)
      md = items["state"]
    except Exception as e:  # a missing or unreadable metadata file
      raise self._unreadable(step, e) from e
    if md is None:
      raise ValueError(f"{self.where(step)} has no 'state' item; it is not "
                       "a zero_jax checkpoint")
    return (dict(getattr(md, "tree", md)),
            items.get("loss_scale") is not None)

  def meta(self, step: int) -> dict[str, Any]:
    """The metadata zero_jax stored with a checkpoint ({} if unreadable:
    it is informative, and a checkpoint without it is not committed)."""
    try:
      meta = json.loads((self._step_path(step) / "meta" / "metadata")
                        .read_text())
    except (OSError, ValueError):
      return {}
    return meta if isinstance(meta, dict) else {}
