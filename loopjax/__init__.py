"""loopjax: recurrent-depth (looped) transformers in JAX."""
