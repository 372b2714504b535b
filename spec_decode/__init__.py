"""Decode runtime: a DeepSeek-V4 model (window + CSA / HCA compressed attention, hash-routed and
sqrt-softplus MoE, mHC), a DSpark-style three-stage draft, and a speculative-decoding engine
(block size 5). Backends: ``reference`` (the spec's per-token loops), ``torch-bf16`` (a sync-free
step model over fixed-size state, PyTorch ops, replayed as CUDA graphs per padded batch size;
eager on a CPU) and ``fused`` (the same graphs with this project's kernels).
``from spec_decode import Engine, EngineConfig``."""

from .config import PRESETS, SMALL, TINY, V4_FLASH_SLICE, V4_PRO_SLICE, EngineConfig, ModelConfig  # noqa: F401
from .engine import CollectiveError, Engine  # noqa: F401
