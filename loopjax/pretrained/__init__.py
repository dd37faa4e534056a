"""Pretrained language models from local Hugging Face directories.

`hf_dir.py` reads a directory (config.json, one or sharded safetensors files)
without torch; a family module (`llama.py`) maps its config to a loopjax
model config and its tensors, by name, to the LoopedTransformer's params;
`init_from.py` starts a looped model's training run from a feedforward one.
"""
