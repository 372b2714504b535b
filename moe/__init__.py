"""MoE kernels: router with padded, packed outputs (:mod:`.router`), MXFP8 routed-input
quantization (:mod:`.quant`), side-stream helper (:mod:`.streams`)."""

import cute_kernels  # noqa: E402,F401 -- first: without the DSL compiler, its stand-ins (cute_kernels.runtime_only)
