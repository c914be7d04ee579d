"""Example models for zero_jax."""

from zero_jax.models.gpt import GPT, GPTConfig, make_loss_fn

__all__ = ["GPT", "GPTConfig", "make_loss_fn"]
