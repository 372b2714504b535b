"""CuTe DSL decode kernels for DeepSeek-V4-class MoE models (Blackwell sm_100a, Hopper sm_90a).

Core: the JIT/compiled-kernel cache (:mod:`.jit`), the on-disk artifact cache
(:mod:`.artifact_cache`), arch dispatch (:mod:`.arch`) and argument checks (:mod:`.validate`).
Kernels import lazily: ``from cute_kernels.row_rms import row_rms``. Without the CuTe DSL
compiler installed, the kernels are served from the artifact cache (:mod:`.runtime_only`).
"""

__version__ = "0.1.0"

from . import runtime_only as _runtime_only  # noqa: E402

_runtime_only.install()

from .arch import current_arch, dispatch, normalize_arch, override_arch  # noqa: F401
