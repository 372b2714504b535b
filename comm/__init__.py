"""Communication: one-shot push all-reduce (optionally fused with the MoE finalize), its
buffers and simulated group (:mod:`.buffers`), backend selection (:mod:`.backend`), and a
CPU model of the protocol (:mod:`.protocol_model`)."""

import cute_kernels  # noqa: E402,F401 -- first: without the DSL compiler, its stand-ins (cute_kernels.runtime_only)
