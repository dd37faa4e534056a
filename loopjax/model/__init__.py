"""The looped (recurrent-depth) transformer."""

from loopjax.model.transformer import LoopedTransformer

__all__ = ["LoopedTransformer"]
