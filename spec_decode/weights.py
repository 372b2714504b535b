"""Model weights from / to a safetensors file.

Name map (one tensor per entry; shapes as :class:`spec_decode.model.TargetModel` /
:class:`spec_decode.draft.DraftModel` build them for the config, any float dtype -- they are
converted to the model's dtype and device on load):

============================  =========================================================
``embed``                     token embedding ``[vocab, hidden]``
``lm_head``                   output head ``[vocab, hidden]``
``layers.{i}.{name}``         layer ``i``'s tensors, ``name`` one of: ``attn_phi``,
                              ``attn_a``, ``attn_b_pre``, ``attn_b_post``, ``attn_b_res``
                              (and the same five with ``moe_``: mHC), ``q_a``, ``q_b``,
                              ``kv_a``, ``k_b``, ``v_b`` (attention), ``idx_q``, ``idx_w``,
                              ``idx_k`` (indexer), ``wo_a`` ``[G, R, (H/G)*head_dim]``,
                              ``wo_b``, ``router``, ``router_bias``, ``gate``, ``up``
                              ``[E, I, hidden]``, ``down`` ``[E, hidden, I]``,
                              ``sh_gate``, ``sh_up``, ``sh_down`` (shared expert)
``draft.w_fuse``, ``draft.w_rec``  the draft module's two stages ``[hidden, 2 hidden]``
============================  =========================================================

With ``kv_cache="latent"`` the attention's ``kv_a`` is ``[rope_dim + kv_lora, hidden]`` (the
shared RoPE key's rows first) and ``k_b`` ``[heads * (head_dim - rope_dim), kv_lora]`` (the
non-RoPE dims of each head's key).

Loading is strict: a missing, unexpected or mis-shaped tensor is a ``ValueError`` naming it,
raised before any weight is replaced. ``EngineConfig(weights=path)`` loads at engine start
(the draft's tensors are optional in the file). Needs the ``safetensors`` package.
"""

from __future__ import annotations

import torch


def named_tensors(target, draft=None) -> dict[str, torch.Tensor]:
    """The name map above -> the models' live tensors."""
    out = {"embed": target.embed, "lm_head": target.lm_head}
    for i, L in enumerate(target.layers):
        for k, v in L.items():
            out[f"layers.{i}.{k}"] = v
    if draft is not None:
        out["draft.w_fuse"], out["draft.w_rec"] = draft.w_fuse, draft.w_rec
    return out


def save_weights(path: str, target, draft=None) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in named_tensors(target, draft).items()}, path)


def load_weights(path: str, target, draft=None) -> None:
    """Copy the file's tensors into ``target`` (and ``draft`` when the file has its tensors)."""
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise ImportError("loading weights needs the safetensors package (pip install safetensors)") from e
    with safe_open(path, framework="pt") as f:
        names = set(f.keys())
        want = named_tensors(target, draft if draft is not None and "draft.w_fuse" in names else None)
        missing = sorted(set(want) - names)
        extra = sorted(names - set(named_tensors(target, draft)))
        if missing:
            raise ValueError(f"weights file {path!r} lacks {len(missing)} tensor(s): {', '.join(missing[:5])}"
                             f"{' ...' if len(missing) > 5 else ''}")
        if extra:
            raise ValueError(f"weights file {path!r} has unexpected tensor(s): {', '.join(extra[:5])}"
                             f"{' ...' if len(extra) > 5 else ''} (see spec_decode.weights for the name map)")
        for k, dst in want.items():
            shape = tuple(f.get_slice(k).get_shape())
            if shape != tuple(dst.shape):
                raise ValueError(f"weights file {path!r}: {k} has shape {list(shape)}, the config needs "
                                 f"{list(dst.shape)}")
        for k, dst in want.items():  # every check passed: now replace
            dst.copy_(f.get_tensor(k).to(dtype=dst.dtype))
