"""DeepSpeed's rule for a step's batch sizes:
``train_batch_size = micro_batch_size * grad_accum_steps * world_size``."""

from __future__ import annotations


def resolve_batch_sizes(train: int | None, micro: int | None,
                        accum: int | None, world_size: int
                        ) -> tuple[int | None, int | None, int]:
  """Any two of the three sizes give the third; one alone leaves
  ``grad_accum_steps`` at 1; none leaves the global batch free.

  Args:
    train: ``ZeroConfig.train_batch_size``, or None.
    micro: ``ZeroConfig.micro_batch_size``, or None.
    accum: ``ZeroConfig.grad_accum_steps``, or None.
    world_size: devices the batch is split over (every mesh axis).

  Returns:
    ``(train_batch_size, micro_batch_size, grad_accum_steps)``; the first
    two are None when the config leaves the batch free.

  Raises:
    ValueError: the three contradict each other or do not divide.
  """
  given = (f"train_batch_size={train}, micro_batch_size={micro}, "
           f"grad_accum_steps={accum}, {world_size} devices")
  if train is None and micro is None:
    return None, None, accum or 1
  if train is None:
    accum = accum or 1
    return micro * accum * world_size, micro, accum
  if micro is None:
    accum = accum or 1
    if train % (accum * world_size):
      raise ValueError(
          f"train_batch_size {train} is not divisible by grad_accum_steps "
          f"x devices = {accum * world_size} ({given})")
    return train, train // (accum * world_size), accum
  if accum is None:
    if train % (micro * world_size):
      raise ValueError(
          f"train_batch_size {train} is not divisible by micro_batch_size "
          f"x devices = {micro * world_size} ({given})")
    return train, micro, train // (micro * world_size)
  if train != micro * accum * world_size:
    raise ValueError(
        f"batch sizes contradict: train_batch_size must equal "
        f"micro_batch_size x grad_accum_steps x devices = "
        f"{micro} x {accum} x {world_size} = {micro * accum * world_size} "
        f"({given}); drop one of the three to have it derived")
  return train, micro, accum
