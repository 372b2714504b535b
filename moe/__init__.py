"""MoE kernels: router with padded, packed outputs (:mod:`.router`), MXFP8 routed-input
quantization (:mod:`.quant`), side-stream helper (:mod:`.streams`)."""
