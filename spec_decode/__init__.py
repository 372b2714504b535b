"""Decode runtime: DeepSeek-V4-class model, three-stage draft, and a speculative-decoding
engine (block size 5). Backends: ``reference`` (the spec's per-token loops) and ``baseline``
(a sync-free step model replayed as CUDA graphs per padded batch size; eager on a CPU). The
``fused`` backend (this project's kernels in those graphs) is still to come (issue 8).
``from spec_decode import Engine, EngineConfig``."""

from .config import SLICE, SMALL, TINY, EngineConfig, ModelConfig  # noqa: F401
from .engine import Engine  # noqa: F401
