"""Decode runtime: DeepSeek-V4-class model (reference backend), three-stage draft, and a
speculative-decoding engine (block size 5). GPU graph capture and the fused backend are
still to come (issue 8). ``from spec_decode import Engine, EngineConfig``."""

from .config import SLICE, TINY, EngineConfig, ModelConfig  # noqa: F401
from .engine import Engine  # noqa: F401
