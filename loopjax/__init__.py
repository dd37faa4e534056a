"""loopjax: recurrent-depth transformers on synthetic knowledge graphs, in JAX."""
