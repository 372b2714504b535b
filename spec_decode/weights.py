"""Model weights from / to safetensors, in DeepSeek-V4's checkpoint names and formats.

Names (deepseek-ai/DeepSeek-V4-Flash ``model.safetensors.index.json``; ``i`` a layer, ``e`` an
expert):

===========================================  ==============================================
``embed.weight``, ``head.weight``             ``[vocab, hidden]``
``norm.weight``, ``hc_head_{fn,base,scale}``  final RMSNorm; V4's learned stream collapse
``layers.i.hc_{attn,ffn}_{fn,base,scale}``    mHC ``[2n + n^2, n C]``, ``[2n + n^2]``, ``[3]``
``layers.i.{attn,ffn}_norm.weight``           the sublayers' RMSNorms
``layers.i.attn.{wq_a,wq_b,wkv,wo_a,wo_b}``   ``.weight`` (``wo_a [G R, H hd / G]``)
``layers.i.attn.{q_norm,kv_norm}.weight``     ``layers.i.attn.attn_sink [H]``
``layers.i.attn.compressor.*``                ``wkv``, ``wgate`` ``.weight``, ``ape``,
                                              ``norm.weight`` (CSA and HCA layers)
``layers.i.attn.indexer.*``                   ``wq_b``, ``weights_proj`` ``.weight`` and a
                                              ``compressor.*`` like the above (CSA layers)
``layers.i.ffn.gate.weight``                  + ``gate.bias`` (top-k layers) or
                                              ``gate.tid2eid [vocab, k]`` (hash-routed)
``layers.i.ffn.experts.e.{w1,w2,w3}.weight``  gate, down, up of routed expert ``e``
``layers.i.ffn.shared_experts.{w1,w2,w3}``    ``.weight``
``draft.{fc,fc_norm,norm}.weight``,           the DSpark-style draft (this project's names:
``draft.mask_embed``, ``draft.hc_head_*``,    DSpark's checkpoint is not public); its
``draft.layers.s.*``                          stages as ``layers.i.*`` (window-only, top-k)
===========================================  ==============================================

Formats accepted on load (and converted to the model's dtype): any float dtype; FP8 e4m3
``X.weight`` with ``X.scale`` (128 x 128 blocks, UE8M0 ``float8_e8m0fnu`` / uint8 or FP32
scales -- the checkpoint's non-expert linears); FP4 ``X.weight`` (``int8`` / ``uint8`` /
``float4_e2m1fn_x2`` ``[N, K/2]``, two e2m1 codes per byte, element ``2i`` in the low nibble)
with UE8M0 ``X.scale [N, K/32]`` (the checkpoint's routed experts). Every conversion is exact
in FP32 (and in bf16: e2m1 codes times powers of two, e4m3 times powers of two).

``load_weights(path, target, draft, layer_map=...)`` reads a file, or a directory of shards
with its ``model.safetensors.index.json``; ``layer_map[i]`` names the checkpoint layer that
fills model layer ``i`` (a slice of the real checkpoint: e.g. V4-Flash's layers 1-4 are
window-only, CSA, HCA, CSA with the first two hash-routed, :data:`spec_decode.config.V4_FLASH_SLICE`).
Loading is strict: a missing or mis-shaped tensor is a ``ValueError`` naming it, raised before
any weight is replaced; tensors the model has no place for are an error too unless
``allow_unused=True`` (the whole real checkpoint holds every layer and its MTP block).
``EngineConfig(weights=path)`` loads at engine start (the draft's tensors are optional).
"""

from __future__ import annotations

import json
import os

import torch

from .model import EXPERT_OPERANDS

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _layer_tensors(prefix: str, L: dict, E: int) -> dict[str, tuple[torch.Tensor, int | None]]:
    """``{checkpoint name: (model tensor, expert index or None)}`` of one layer dict."""
    out = {}
    if EXPERT_OPERANDS[0] in L:
        raise ValueError("weights: this model's routed experts were converted to MXFP8 as it was made "
                         "(on_layer=quantize_layer_experts); load into a model made without on_layer")
    for k, v in L.items():
        if k.startswith("ffn.experts."):
            w = k[len("ffn.experts."):]
            for e in range(E):
                out[f"{prefix}ffn.experts.{e}.{w}.weight"] = (v, e)
        else:
            out[prefix + k] = (v, None)
    return out


def named_tensors(target, draft=None) -> dict[str, tuple[torch.Tensor, int | None]]:
    """Checkpoint name -> (the model tensor, the expert index it is a slice of, or None)."""
    E = target.cfg.experts
    out = {k: (v, None) for k, v in target.w.items()}
    for i, L in enumerate(target.layers):
        out.update(_layer_tensors(f"layers.{i}.", L, E))
    if draft is not None:
        out.update({f"draft.{k}": (v, None) for k, v in draft.w.items()})
        for s, L in enumerate(draft.stages):
            out.update(_layer_tensors(f"draft.layers.{s}.", L, E))
    return out


def save_weights(path: str, target, draft=None) -> None:
    from safetensors.torch import save_file

    save_file({k: (v if e is None else v[e]).detach().contiguous().cpu()
               for k, (v, e) in named_tensors(target, draft).items()}, path)


def dequantize(w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """A checkpoint tensor in FP32: as is, FP8 e4m3 with 128 x 128 block scales, or packed FP4
    (e2m1 pairs) with one UE8M0 scale per 32 elements of a row."""
    if scale is None:
        if w.dtype in (torch.float8_e4m3fn, torch.uint8, torch.int8):
            raise ValueError(f"a {w.dtype} tensor needs its .scale")
        return w.float() if w.is_floating_point() else w
    s = 2.0 ** (scale.view(torch.uint8).float() - 127) if scale.dtype in (torch.float8_e8m0fnu, torch.uint8) \
        else scale.float()
    if w.dtype == torch.float8_e4m3fn:
        N, K = w.shape
        s = s.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
        return w.float() * s
    if w.dtype in (torch.int8, torch.uint8, torch.float4_e2m1fn_x2):
        b = w.contiguous().view(torch.uint8).long()
        codes = torch.stack((b & 0xF, b >> 4), -1).flatten(-2)  # element 2i: the low nibble
        mag = torch.tensor(_E2M1, dtype=torch.float32, device=w.device)[codes & 7]
        vals = torch.where(codes >= 8, -mag, mag)
        return vals * s.repeat_interleave(32, -1)[..., :vals.shape[-1]]
    raise ValueError(f"a {w.dtype} tensor with a .scale is not a supported checkpoint format")


class _Checkpoint:
    """One safetensors file or a directory of shards (with model.safetensors.index.json)."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self._open = safe_open
        if os.path.isdir(path):
            index = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
            self.where = {k: os.path.join(path, f) for k, f in index.items()}
        else:
            with safe_open(path, framework="pt") as f:
                self.where = {k: path for k in f.keys()}
        self._files = {}

    def names(self) -> set[str]:
        return set(self.where)

    def _file(self, name: str):
        f = self.where[name]
        if f not in self._files:
            self._files[f] = self._open(f, framework="pt")
        return self._files[f]

    def get(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name)

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        sl = self._file(name).get_slice(name)
        return tuple(sl.get_shape()), sl.get_dtype()


def load_weights(path: str, target, draft=None, layer_map: dict[int, int] | None = None,
                 allow_unused: bool = False) -> None:
    """Copy the checkpoint's tensors into ``target`` (and ``draft`` when it has its tensors)."""
    try:
        ck = _Checkpoint(path)
    except ImportError as e:
        raise ImportError("loading weights needs the safetensors package (pip install safetensors)") from e
    names = ck.names()
    layer_map = dict(layer_map or {})

    def source(name: str) -> str:
        if name.startswith("layers."):
            i, rest = name[len("layers."):].split(".", 1)
            return f"layers.{layer_map.get(int(i), int(i))}.{rest}"
        return name

    want = named_tensors(target, draft if draft is not None and "draft.fc.weight" in names else None)
    src = {k: source(k) for k in want}
    missing = sorted(k for k, s in src.items() if s not in names)
    if missing:
        raise ValueError(f"weights {path!r} lack {len(missing)} tensor(s): {', '.join(src[k] for k in missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}")
    used = set(src.values()) | {s[:-len(".weight")] + ".scale" for s in src.values() if s.endswith(".weight")}
    extra = sorted(names - used - {source(k) for k in named_tensors(target, draft)})
    if extra and not allow_unused:
        raise ValueError(f"weights {path!r} have unexpected tensor(s): {', '.join(extra[:5])}"
                         f"{' ...' if len(extra) > 5 else ''} (see spec_decode.weights for the name map; "
                         f"allow_unused=True to load a slice of a larger checkpoint)")
    for k, (dst, e) in want.items():  # shapes from the headers: every check before any copy
        shape = tuple(dst.shape[1:] if e is not None else dst.shape)
        have, dt = ck.shape_dtype(src[k])
        if dt in ("I8", "U8", "F4") and src[k][:-len(".weight")] + ".scale" in names:
            have = have[:-1] + (2 * have[-1],)  # packed FP4: two elements a byte
        if have != shape:
            raise ValueError(f"weights {path!r}: {src[k]} has shape {list(have)}, the config needs {list(shape)}")
    for k, (dst, e) in want.items():  # one tensor at a time: a slice of the real checkpoint fits
        s = src[k]
        sc = s[:-len(".weight")] + ".scale"
        val = dequantize(ck.get(s), ck.get(sc) if s.endswith(".weight") and sc in names else None)
        (dst if e is None else dst[e]).copy_(val.to(device=dst.device, dtype=dst.dtype))
