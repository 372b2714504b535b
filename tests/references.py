"""FP32/FP64 references in plain PyTorch: the specification each kernel is tested against."""

import torch


def row_rms_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(x^2) + eps) per row, computed in float64 on the exact upcast of x."""
    return torch.rsqrt(x.double().square().mean(dim=-1) + eps)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()
