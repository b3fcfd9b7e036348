"""The blocks in numpy, without torch: what a node serves on a CPU where torch is absent or too big.

The same architectures as vit.py and lm/model.py, on the same weights (safetensors, read with
safetensors.numpy), in float32: `ViTBlock` (images and text, the position-aware variant, token masks),
`DecoderBlock` (RMSNorm, rotary positions, grouped-query attention, SwiGLU) with its `KVCache`. Compared
with the torch blocks in tests/node/test_lean_engine.py. No training: forward only.
"""
