"""FP32/FP64 references in plain PyTorch: the specification each kernel is tested against."""

import torch


def row_rms_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(x^2) + eps) per row, computed in float64 on the exact upcast of x."""
    return torch.rsqrt(x.double().square().mean(dim=-1) + eps)


def rms_norm_ref(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, in float64 on the exact upcast
    (no intermediate rounding)."""
    xd = x.double()
    y = xd * torch.rsqrt(xd.square().mean(dim=-1, keepdim=True) + eps)
    return y if weight is None else y * weight.double()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def masked_softmax_ref(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of scores [*lead, H, M] in float64 where mask [*lead, W >= M]
    selects the key (its first M columns), -inf elsewhere; a row selecting nothing is zeros."""
    M = scores.shape[-1]
    x = scores.double().masked_fill(~mask[..., None, :M], float("-inf"))
    return x.softmax(-1).nan_to_num(0.0)


# ----------------------------------------------------------------------- MXFP8 ---------
def mxfp8_quant_ref(x: torch.Tensor):
    """MXFP8 of bf16 x [R, K] (K % 32 == 0) from the definition, in float64.

    Per block of 32: ``amax = max |x|``; the scale is the smallest power of two ``2^e`` with
    ``amax / 2^e <= 448`` -- ``e = ceil(log2(amax / 448))``, the round-up rule of cuBLAS /
    TensorRT-LLM / FlashInfer (not OCP's floor rule, which can clip) -- stored as the byte
    ``clamp(e + 127, 0, 254)`` (an all-zero block: 0); ``q = e4m3(x / 2^(byte - 127))``
    rounded to nearest even (torch's conversion); a block holding NaN or +-Inf: byte 0xFF and
    every q 0x7F (e4m3fn has no Inf).

    Returns (q uint8 [R, K] (e4m3 bit patterns), scale uint8 [R, K/32]).
    """
    R, K = x.shape
    nb = K // 32
    xd = x.double().view(R, nb, 32)
    finite = torch.isfinite(xd).all(-1)
    amax = torch.where(torch.isfinite(xd), xd.abs(), torch.zeros_like(xd)).amax(-1)
    e = torch.ceil(torch.log2(amax / 448.0))  # -inf for an all-zero block
    byte = (e + 127).clamp(0, 254).nan_to_num(0.0)
    q = (xd / torch.exp2(byte - 127)[..., None]).float().to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where(finite[..., None], q, torch.full_like(q, 0x7F))
    byte = torch.where(finite, byte, torch.full_like(byte, 255.0))
    return q.view(R, K), byte.to(torch.uint8)


def mx_boundary_blocks() -> tuple[torch.Tensor, list[int]]:
    """Deterministic blocks on the MXFP8 scale rule's edges, each block's maximum the value named
    (the other 31 elements far smaller, so nothing hides it): bf16 ``[n, 32]`` and the scale
    byte the definition gives each (``e = ceil(log2(amax / 448))``, byte ``e + 127``)."""
    rows, want = [], []

    def block(top, fill=2.0 ** -20, n=31, byte=None):
        b = torch.full((32,), fill)
        b[:n] = fill * torch.linspace(-1, 1, n)
        b[7] = top
        rows.append(b)
        want.append(byte)

    block(448.0, byte=127)                       # amax / 2^0 == 448 exactly: no bump
    block(-1.75 * 2.0 ** 5, byte=127 + 5 - 8)    # 1.75 * 2^k: e = k - 8
    block(1.7578125 * 2.0 ** 5, byte=127 + 5 - 7)  # the next bf16 above 1.75 * 2^k: e = k - 7
    block(1.0 * 2.0 ** 5, byte=127 + 5 - 8)      # m = 1: e = k - 8
    block(1.9921875 * 2.0 ** -3, byte=127 - 3 - 7)  # the largest mantissa
    block(2.0 ** 120, byte=127 + 120 - 8)        # large
    block(0.0, fill=0.0, byte=0)                 # all zero
    block(2.0 ** -130, fill=2.0 ** -133, byte=0)  # bf16 subnormals only: e < -127 clamps
    block(2.0 ** -126 * 1.5, fill=0.0, byte=0)   # smallest normals: e = -134 clamps
    block(float("nan"), byte=255)
    block(float("inf"), byte=255)
    block(-float("inf"), byte=255)
    return torch.stack(rows).bfloat16(), want


def mxfp8_dequant_ref(q_bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 x' = e4m3(q) * 2**(scale - 127); scale 0xFF -> NaN."""
    R, K = q_bits.shape
    qf = q_bits.contiguous().view(torch.float8_e4m3fn).float().view(R, K // 32, 32)
    s = torch.exp2(scale.float() - 127)
    s = torch.where(scale == 0xFF, torch.full_like(s, float("nan")), s)
    return (qf * s[..., None]).view(R, K)


def expert_gemm_ref(aq: torch.Tensor, asc: torch.Tensor, wq: torch.Tensor, wsc, offs: torch.Tensor,
                    counts) -> torch.Tensor:
    """float64 ``y [rows, N]`` of the MXFP8 expert GEMM from the definition: expert ``e``'s rows
    ``[offs[e], offs[e] + counts[e])`` of the dequantised A (plain scales ``asc [rows, K/32]``)
    times its dequantised weights (``wsc[e] [N, K/32]``); other rows 0."""
    a = mxfp8_dequant_ref(aq, asc).double()
    y = torch.zeros(aq.shape[0], wq.shape[1], dtype=torch.float64)
    for e in range(wq.shape[0]):
        lo, n = int(offs[e]), int(counts[e])
        if n:
            y[lo:lo + n] = a[lo:lo + n] @ mxfp8_dequant_ref(wq[e], wsc[e]).double().T
    return y


def e4m3_step_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One e4m3 step (ulp) at |x| [R, K] in blocks of 32 with E8M0 ``scale`` [R, K/32]: 2^-3 of
    x's binade for normals, 2^-9 (the subnormal quantum) below 2^-6, times the block scale.
    A bf16 ulp of difference before the MX quantiser (FP32 summation order, the GPU's exp) may
    move a byte by at most this much."""
    R, K = x.shape
    s = torch.exp2(scale.float() - 127)[..., None]
    y = (x.float().abs().view(R, K // 32, 32) / s).clamp_min(2.0**-6)
    return (torch.exp2(torch.floor(torch.log2(y)) - 3) * s).view(R, K)


def swizzled_offset(r, c, C: int):
    """Byte offset of scale (row r, scale column c) in the block-scaled MMA's layout
    (cuBLAS "1D block scaling factors layout" / CUTLASS's 128 x 4 scale-factor atom), from
    its published formula: atoms of 128 rows x 4 columns (512 bytes) ordered with the column
    blocks fastest; inside an atom ``(r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4``."""
    n_col_blocks = -(-C // 4)
    return ((r // 128) * n_col_blocks + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def swizzle_scales_ref(scale: torch.Tensor) -> torch.Tensor:
    """[R, K/32] -> the flat swizzled layout (every byte placed by :func:`swizzled_offset`;
    rows padded to 128 and columns to 4 with zeros)."""
    R, C = scale.shape
    size = -(-R // 128) * 128 * -(-C // 4) * 4
    flat = torch.zeros(size, dtype=scale.dtype)
    r, c = torch.meshgrid(torch.arange(R), torch.arange(C), indexing="ij")
    flat[swizzled_offset(r, c, C).flatten()] = scale.flatten()
    return flat


def unswizzle_scales_ref(flat: torch.Tensor, R: int, C: int) -> torch.Tensor:
    r, c = torch.meshgrid(torch.arange(R), torch.arange(C), indexing="ij")
    return flat.cpu()[swizzled_offset(r, c, C)].contiguous()


# ---------------------------------------------------------------------- router ---------
def expert_scores_ref(logits, score="sigmoid"):
    """The router's expert scores from their definitions, in float64, returned as FP32:
    ``sigmoid(x) = 1 / (1 + e^-x)``; DeepSeek-V4's ``sqrt(softplus(x)) = sqrt(ln(1 + e^x))``."""
    x = logits.double()
    if score == "sigmoid":
        s = 1.0 / (1.0 + torch.exp(-x))
    elif score == "sqrtsoftplus":
        s = torch.sqrt(torch.log1p(torch.exp(x)))
    else:
        raise ValueError(score)
    return s.float()


def grouped_topk_ref(logits, bias, n_group, topk_group, k, scale, score="sigmoid"):
    """DeepSeek-V3 (sigmoid, grouped) / V4 (sqrt-softplus, n_group = 1) top-k in FP32 on the
    float64 scores; ties -> lower index (stable sorts)."""
    s = expert_scores_ref(logits, score)
    b = s + bias.float() if bias is not None else s.clone()
    T, E = b.shape
    if n_group > 1:
        gs = E // n_group
        top2 = torch.sort(b.view(T, n_group, gs), dim=-1, descending=True, stable=True).values[..., :2]
        gscore = top2[..., 0] + top2[..., 1]
        order = torch.sort(gscore, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        keep = torch.zeros(T, n_group, dtype=torch.bool)
        keep.scatter_(1, order, True)
        b = torch.where(keep.repeat_interleave(gs, dim=1), b, torch.full_like(b, float("-inf")))
    ids = torch.sort(b, dim=-1, descending=True, stable=True).indices[:, :k]
    return ids.to(torch.int32), routing_weights_ref(s, ids, scale), b


def routing_weights_ref(s, ids, scale):
    """A token's routing weights: the expert scores ``s`` of its picks ``ids [T, k]``, normalised
    by their FP32 sum taken in selection order (the kernel's order), times ``scale``."""
    w = s.gather(1, ids.long())
    ssum = torch.zeros(w.shape[0])
    for i in range(w.shape[1]):
        ssum = ssum + w[:, i]
    return w / (ssum[:, None] + 1e-20) * scale


def hash_route_ref(logits, token_ids, tid2eid, k, scale, score="sqrtsoftplus"):
    """DeepSeek-V4's hash-routed layers: experts ``tid2eid[token_ids]`` (ids clamped into the
    table, as the kernel does), weights = their scores (float64 definition, FP32) normalised
    in selection order, times ``scale``."""
    s = expert_scores_ref(logits, score)
    tok = token_ids.long().clamp(0, tid2eid.shape[0] - 1)
    ids = tid2eid[tok].long()
    return ids.to(torch.int32), routing_weights_ref(s, ids, scale)


def align_ref(ids: torch.Tensor, E: int, tile: int):
    """moe_align_block_size: counts, padded offsets, sorted routed rows (sentinel T*k), tile map."""
    T, k = ids.shape
    flat = ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=E).to(torch.int32)
    padded = (counts + tile - 1) // tile * tile
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(padded, 0)
    total = int(offsets[-1])
    sorted_ids = torch.full((total,), T * k, dtype=torch.int32)
    for e in range(E):
        rows = torch.nonzero(flat == e).flatten().to(torch.int32)
        sorted_ids[offsets[e]: offsets[e] + rows.numel()] = rows
    tile_expert = torch.repeat_interleave(torch.arange(E, dtype=torch.int32), padded // tile)
    return counts, offsets, sorted_ids, tile_expert, total


def routed_row_pos_ref(sorted_ids: torch.Tensor, rows: int) -> torch.Tensor:
    """The router's ``routed_row_pos`` of a packing: for each of the ``rows`` (= T k) routed
    rows, the slot of ``sorted_ids`` that holds it (padding slots, ``>= rows``, hold none)."""
    live = sorted_ids < rows
    pos = torch.empty(rows, dtype=torch.int32)
    pos[sorted_ids[live].long()] = torch.nonzero(live).flatten().int()
    return pos


# ------------------------------------------------------------------------ WO-A ---------
def wo_a_ref(o: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y[t, g*R + r] = sum_d w[g, r, d] * o[t, g-th head group].flatten()[d], float64."""
    T = o.shape[0]
    G, R, Dg = w.shape
    y = torch.einsum("tgd,grd->tgr", o.reshape(T, G, Dg).double().cpu(), w.double().cpu())
    return y.reshape(T, G * R)


def gemm_error_bound(o: torch.Tensor, w: torch.Tensor, K: int, weight_rounding: float = 0.0) -> torch.Tensor:
    """Per-element bound on |bf16 WO-A output - float64 product| of a K-long FP32-accumulated sum:
    the output's bf16 rounding (2^-8 of |y|, bf16's unit roundoff), the FP32 accumulation
    (K * 2^-24 of sum |o w|, any order) and, where the weights were rounded before the MMA, that
    rounding (``weight_rounding`` relative, of sum |o w|). A wrong or unwritten element breaks it."""
    T = o.shape[0]
    G, R, Dg = w.shape
    y = wo_a_ref(o, w).abs()
    mag = torch.einsum("tgd,grd->tgr", o.reshape(T, G, Dg).double().abs().cpu(),
                       w.double().abs().cpu()).reshape(T, G * R)
    return 2.0 ** -8 * y + (K * 2.0 ** -24 + weight_rounding) * mag + 1e-30


# ----------------------------------------------------------- finalize / all-reduce -----
def finalize_shared_ref(y, w, pos, shared=None):
    """routed = bf16(sum_i (w[:, i] * y[pos[:, i]]) in FP32, in order i, each product and sum
    rounded separately); out = bf16(float(routed) + float(shared))."""
    T, k = w.shape
    pos = pos.view(T, k).long()
    acc = torch.zeros(T, y.shape[1])
    for i in range(k):
        prod = w[:, i:i + 1].float() * y[pos[:, i]].float()
        acc = acc + prod
    routed = acc.bfloat16()
    if shared is None:
        return routed
    return (routed.float() + shared.float()).bfloat16()


def allreduce_ref(parts):
    """bf16(sum over ranks in rank order, FP32)."""
    acc = torch.zeros_like(parts[0], dtype=torch.float32)
    for p in parts:
        acc = acc + p.float()
    return acc.bfloat16()


# ------------------------------------------------------------------------- mHC ---------
def mhc_stats_ref(x, phi, alpha, bias, eps, iters, hc_eps=0.0):
    """H [T, 2n + n*n] = [H_pre | H_post | H_res] in float64 (DeepSeek-V4's ``hc_split_sinkhorn``:
    pre = sigmoid + hc_eps, post = 2 sigmoid, comb = row softmax + hc_eps, then a column
    normalisation and iters - 1 (row, column) rounds, denominators + hc_eps; hc_eps = 0 is the
    plain Sinkhorn-Knopp of exp, rows first).

    x [T, n, C] bf16, phi [2n + n*n, n*C] (row j is column j of the model's phi [n*C, m]).
    """
    T, n, C = x.shape
    xf = x.double().reshape(T, n * C)
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    P = (xf * r) @ phi.double().T
    a, b = alpha.double(), bias.double()
    h_pre = torch.sigmoid(a[0] * P[:, :n] + b[:n]) + hc_eps
    h_post = 2 * torch.sigmoid(a[1] * P[:, n:2 * n] + b[n:2 * n])
    M = (a[2] * P[:, 2 * n:] + b[2 * n:]).view(T, n, n)
    if iters == 0:
        return torch.cat([h_pre, h_post, M.exp().reshape(T, n * n)], -1)
    M = M.softmax(-1) + hc_eps
    M = M / (M.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        M = M / (M.sum(-1, keepdim=True) + hc_eps)
        M = M / (M.sum(-2, keepdim=True) + hc_eps)
    return torch.cat([h_pre, h_post, M.reshape(T, n * n)], -1)


def mhc_pre_mix_ref(x, h):
    """u = bf16(sum_i rn(h_pre_i * x_i)) with FP32 products and sums in stream order."""
    T, n, C = x.shape
    acc = torch.zeros(T, C, dtype=torch.float32)
    for i in range(n):
        acc = acc + h[:, i:i + 1].float() * x[:, i].float()
    return acc.bfloat16()


def mhc_post_mix_ref(x, h, f):
    """X'_i = bf16(sum_j rn(H_res_ij * X_j) + rn(H_post_i * F)), FP32, in that order."""
    T, n, C = x.shape
    h = h.float()
    out = torch.empty_like(x)
    for i in range(n):
        acc = torch.zeros(T, C, dtype=torch.float32)
        for j in range(n):
            acc = acc + h[:, 2 * n + i * n + j, None] * x[:, j].float()
        acc = acc + h[:, n + i, None] * f.float()
        out[:, i] = acc.bfloat16()
    return out


# --------------------------------------------------------------------- indexer ---------
def indexer_scores_ref(q, w, k_cache, kv_offset, kv_len, pos, max_keys, slot_valid=None):
    """float64 scores [T, max_keys] with the candidate mask applied (-inf = not a candidate)."""
    T, H, D = q.shape
    R = k_cache.shape[0]
    out = torch.full((T, max_keys), float("-inf"), dtype=torch.float64)
    for t in range(T):
        off = int(kv_offset[t])
        lim = min(int(pos[t]) + 1, int(kv_len[t]), max_keys, R - off) if off >= 0 else 0
        if lim <= 0:
            continue
        keys = k_cache[off:off + lim].double()
        s = (torch.relu(keys @ q[t].double().T) * w[t].double()).sum(-1)
        if slot_valid is not None:
            s = torch.where(slot_valid[off:off + lim].bool(), s, torch.full_like(s, float("-inf")))
        out[t, :lim] = s
    return out


def v4_indexer_scores_ref(q, w, pool, entry_offset, n_entries, pos, compress_ratio, max_entries):
    """float64 scores [T, max_entries] of DeepSeek-V4's Lightning Indexer over compressed entries,
    written from its definition: ``sum_h (w[t, h] * H**-0.5) * relu(q[t, h] . pool[i]) * D**-0.5``
    over entries ``i < min((pos[t] + 1) // compress_ratio, n_entries[t])`` (an entry is visible
    once its whole window of ``compress_ratio`` tokens ends at or before the query); -inf elsewhere."""
    T, H, D = q.shape
    out = torch.full((T, max_entries), float("-inf"), dtype=torch.float64)
    for t in range(T):
        p = int(pos[t])
        visible = (p + 1) // compress_ratio if p >= 0 else 0
        lim = min(visible, int(n_entries[t]), max_entries)
        if lim <= 0:
            continue
        off = int(entry_offset[t])
        keys = pool[off:off + lim].double()
        logits = torch.relu(q[t].double() @ keys.T) * D ** -0.5          # [H, lim]
        out[t, :lim] = (logits * (w[t].double() * H ** -0.5)[:, None]).sum(0)
    return out


def e2m1_value_ref(code: int) -> float:
    """The OCP MX e2m1 value of a 4-bit code: sign bit 3, exponent bits 2-1 (bias 1), mantissa
    bit 0; exponent 0 is subnormal (m * 0.5)."""
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    v = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -v if s else v


def mxfp4_dequant_ref(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 [N, K] of MXFP4 ``packed [N, K/2]`` uint8 (element 2i in the low nibble) and UE8M0
    ``scale [N, K/32]`` uint8 (255 -> NaN)."""
    lut = torch.tensor([e2m1_value_ref(c) for c in range(16)], dtype=torch.float64)
    p = packed.to(torch.int64)
    vals = lut[torch.stack((p & 0xF, p >> 4), dim=-1).reshape(p.shape[0], -1)]
    f = torch.exp2(scale.double() - 127)
    f = torch.where(scale == 255, torch.full_like(f, float("nan")), f)
    return (vals.view(p.shape[0], -1, 32) * f[..., None]).view(p.shape[0], -1)


def sink_attention_ref(q, kv, rows, sink, scale, rotate=None):
    """Decode attention with a sink from its definition, FP64 on the CPU: ``q [T, H, D]``,
    ``kv [R, D]``, ``rows [T, K]`` (key k valid iff ``0 <= rows[t, k] < R``), ``sink [H]``,
    ``rotate`` None or ``[T, r/2, 2]`` (cos, sin) per pair of the last r features. -> ``(out,
    mag)``: the rotated output ``[T, H, D]`` and, per element, ``sum_k p_k |v_k|`` (for a rotated
    pair, of both features weighted by |cos|, |sin| as they enter it) -- the magnitude the
    probabilities' roundings scale -- and the scores' magnitudes ``scale sum_d |q_d k_d|``
    ``[T, H, K]`` (what their FP32 rounding scales)."""
    q, kv, sink = q.cpu().double(), kv.cpu().double(), sink.cpu().double()
    rows = rows.cpu().long()
    R = kv.shape[0]
    valid = (rows >= 0) & (rows < R)
    keys = kv[rows.clamp(0, R - 1)]  # [T, K, D]
    s = torch.einsum("thd,tkd->thk", q, keys) * scale
    smag = torch.einsum("thd,tkd->thk", q.abs(), keys.abs()) * abs(scale)
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    full = torch.cat([s, sink[None, :, None].expand(s.shape[0], -1, 1)], -1)
    p = full.softmax(-1)[..., :-1]
    o = torch.einsum("thk,tkd->thd", p, keys)
    mag = torch.einsum("thk,tkd->thd", p, keys.abs())
    if rotate is not None:
        r = 2 * rotate.shape[1]
        cs = rotate.cpu().double()
        c, sn = cs[:, None, :, 0], cs[:, None, :, 1]
        a, b = o[..., -r::2], o[..., -r + 1::2]
        ma, mb = mag[..., -r::2], mag[..., -r + 1::2]
        o = torch.cat([o[..., :-r], torch.stack([a * c - b * sn, a * sn + b * c], -1).flatten(-2)], -1)
        mag = torch.cat([mag[..., :-r], torch.stack([ma * c.abs() + mb * sn.abs(), ma * sn.abs() + mb * c.abs()],
                                                    -1).flatten(-2)], -1)
    return o, mag, smag.masked_fill(~valid[:, None, :], 0.0)


def compressor_entry_ref(rows, ape, norm_weight, eps, overlap, cs=None):
    """One compressed entry from its window's raw rows, the definition with DeepSeek-V4's bf16
    rounding points (``spec_decode.model.compress_entries`` then the rms_norm rounding sequence),
    evaluated in FP64 on the CPU: ``rows [W, 2 ch]`` (kv | gate; rows before position 0 left
    out), ``ape [m, ch]`` -- the window's row i takes ``ape[i % m]`` (CSA: rows of the previous
    window the first d channels, the window's own the second). Returns ``(y, scale)`` -- the
    entry ``[d]`` (rotated by ``cs [r/2, 2]`` if given) and, per channel, the magnitude a 1-ulp
    flip of an intermediate rounding moves it by: ``r |norm_w| sum_i w_i |kv_i|`` (pairs mixed
    as they rotate)."""
    def bf(x):
        return x.to(torch.bfloat16).double()

    rows, ape, nw = rows.cpu().double(), ape.cpu().double(), norm_weight.cpu().double()
    d = nw.shape[0]
    ch = rows.shape[1] // 2
    m = ape.shape[0]
    W = rows.shape[0]
    first = (2 * m if overlap else m) - W  # window rows missing before position 0
    kv, g = [], []
    for j in range(W):
        i = first + j
        h = d if overlap and i >= m else 0
        kv.append(rows[j, h:h + d])
        g.append(bf(rows[j, ch + h:ch + h + d] + ape[i % m, h:h + d]))
    kv, g = torch.stack(kv), torch.stack(g)
    w = bf(g.softmax(0))
    x = bf((bf(kv * w)).sum(0))
    r = bf(torch.rsqrt(x.square().mean() + eps))
    y = bf(bf(x * r) * nw)
    mag = r * nw.abs() * (w * kv.abs()).sum(0)
    if cs is not None:
        rr = 2 * cs.shape[0]
        c, s = cs.cpu().double()[:, 0], cs.cpu().double()[:, 1]
        a, b = y[d - rr::2].clone(), y[d - rr + 1::2].clone()
        ma, mb = mag[d - rr::2].clone(), mag[d - rr + 1::2].clone()
        y[d - rr::2], y[d - rr + 1::2] = a * c - b * s, a * s + b * c
        mag[d - rr::2], mag[d - rr + 1::2] = ma * c.abs() + mb * s.abs(), ma * s.abs() + mb * c.abs()
    return y, mag


def greedy_shortfall(ref: torch.Tensor, picks: torch.Tensor, noise) -> torch.Tensor:
    """Per row of logits ``ref`` [N, V] (the yardstick) and the token ``picks`` [N] another
    evaluation chose: how far the pick's logit falls below the row's maximum, in units of a
    near-tie -- a quarter of the row's spread (std) or 8 x ``noise`` (the rms logit error of the
    other evaluation, [N] or a number), whichever is larger. <= 1: the pick is the argmax or a
    near-tie that rounding may flip; a state row read from the wrong position, or a lost
    partial sum, picks tokens whole standard deviations down."""
    short = ref.amax(-1) - torch.gather(ref, -1, picks[:, None])[:, 0]  # >= 0; 0 where equal
    return short / torch.maximum(0.25 * ref.std(-1), 8 * torch.as_tensor(noise, device=ref.device))
