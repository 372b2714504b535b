"""Decode runtime: a DeepSeek-V4-class model, a three-stage draft, and a speculative-decoding
engine (block size 5). Backends: ``reference`` (the spec's per-token loops), ``baseline`` (a
sync-free step model of PyTorch ops replayed as CUDA graphs per padded batch size; eager on a
CPU) and ``fused`` (the same graphs with this project's kernels).
``from spec_decode import Engine, EngineConfig``."""

from .config import SLICE, SMALL, TINY, EngineConfig, ModelConfig  # noqa: F401
from .engine import Engine  # noqa: F401
