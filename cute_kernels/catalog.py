"""The project's kernel catalogue: every kernel module of ``cute_kernels``, ``moe`` and ``comm``.

Kernel modules register a :class:`cute_kernels.jit.KernelDef` when they are imported; the
core (:mod:`cute_kernels.jit`, the caches, :mod:`cute_kernels.arch`, :mod:`cute_kernels.validate`)
never imports them. What needs *every* kernel -- the AOT build (``python -m cute_kernels build``),
the machine-code checks -- calls :func:`kernels`, which imports this list once. The catalogue
sits above ``moe`` and ``comm`` in the dependency order; nothing below it imports it.

Add a line here for each new kernel module.
"""

from __future__ import annotations

import importlib

from . import jit

MODULES = (
    "cute_kernels.row_rms",
    "cute_kernels.rms_norm",
    "cute_kernels.masked_softmax",
    "cute_kernels.wo_a",
    "cute_kernels.wo_a_decode",
    "cute_kernels.wo_a_decode_swap_ab",
    "cute_kernels.wo_a_decode_fp8",
    "cute_kernels.wo_a_fp8_act_sm90",
    "cute_kernels.dequant_fp8_blockwise",
    "cute_kernels.draft_head_fp8",
    "cute_kernels.mhc_stats",
    "cute_kernels.mhc_pre_mix",
    "cute_kernels.mhc_post_mix",
    "cute_kernels.indexer_scores",
    "cute_kernels.indexer_scores_fp8",
    "cute_kernels.indexer_scores_sm90",
    "cute_kernels.indexer_scores_token_group_sm90",
    "cute_kernels.indexer_scores_sm100",
    "cute_kernels.indexer_topk",
    "cute_kernels.indexer_topk_split",
    "cute_kernels.sink_attention",
    "cute_kernels.compressor_pool",
    "moe.quant",
    "moe.router",
    "moe.finalize",
    "moe.experts_sm100",
    "moe.experts_tiled_sm90",
    "moe.experts_swap_ab_sm90",
    "comm.push_allreduce",
)


def kernels() -> dict[str, jit.KernelDef]:
    """Every kernel of the project by name (importing the modules that register them)."""
    for name in MODULES:
        importlib.import_module(name)
    return jit.registry()
