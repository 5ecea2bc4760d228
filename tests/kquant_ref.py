"""A scalar, line-by-line transcription of ggml's reference K-quantizers (ggml/src/ggml-quants.c:
make_qkx2_quants, make_qx_quants, quantize_row_q4_K_ref, quantize_row_q5_K_ref, quantize_row_q6_K_ref,
no importance matrix), for tests/test_export_types.py.

The `gguf` package has no K-quantizers, so this is what export.py's vectorized numpy port is checked
against, block by block. Every operation is rounded to float32 (np.float32 scalars) in the C order of
evaluation, without FMA contraction; loops stay loops. Slow (tens of ms per block): for a few blocks only.
"""
from __future__ import annotations

import numpy as np

f = np.float32

def nearest_int(v):
    return int(np.rint(f(v)))

def make_qkx2(x, w, nmax, rmin, rdelta, nstep):
    n = len(x)
    mn = x[0]; mx = x[0]; sum_w = w[0]; sum_x = f(sum_w * x[0])
    for i in range(1, n):
        if x[i] < mn: mn = x[i]
        if x[i] > mx: mx = x[i]
        sum_w = f(sum_w + w[i]); sum_x = f(sum_x + f(w[i] * x[i]))
    if mn > 0: mn = f(0)
    if mx == mn:
        return f(0), f(-mn), [0] * n
    iscale = f(f(nmax) / f(mx - mn)); scale = f(f(1) / iscale)
    L = [0] * n; best = f(0)
    for i in range(n):
        l = nearest_int(f(iscale * f(x[i] - mn))); L[i] = max(0, min(nmax, l))
        diff = f(f(f(scale * f(L[i])) + mn) - x[i]); diff = f(diff * diff)
        best = f(best + f(w[i] * diff))
    for st in range(nstep + 1):
        iscale = f(f(f(f(rmin) + f(f(rdelta) * f(st))) + f(nmax)) / f(mx - mn))
        sl = sl2 = sxl = f(0); La = [0] * n
        for i in range(n):
            l = max(0, min(nmax, nearest_int(f(iscale * f(x[i] - mn))))); La[i] = l
            wl = f(w[i] * f(l))
            sl = f(sl + wl); sl2 = f(sl2 + f(wl * f(l))); sxl = f(sxl + f(wl * x[i]))
        D = f(f(sum_w * sl2) - f(sl * sl))
        if D > 0:
            ts = f(f(f(sum_w * sxl) - f(sum_x * sl)) / D)
            tm = f(f(f(sl2 * sum_x) - f(sl * sxl)) / D)
            if tm > 0:
                tm = f(0); ts = f(sxl / sl2)
            cur = f(0)
            for i in range(n):
                diff = f(f(f(ts * f(La[i])) + tm) - x[i]); diff = f(diff * diff)
                cur = f(cur + f(w[i] * diff))
            if cur < best:
                L = La; best = cur; scale = ts; mn = tm
    return scale, f(-mn), L

def q45k_block(x, nmax, rmin, rdelta, nstep):
    scales = []; mins = []; L = []
    max_scale = f(0); max_min = f(0)
    for j in range(8):
        xs = x[32 * j:32 * j + 32]
        s2 = f(0)
        for v in xs: s2 = f(s2 + f(v * v))
        av = f(np.sqrt(f(s2 / f(32))))
        w = [f(av + abs(v)) for v in xs]
        sc, m, l = make_qkx2(xs, w, nmax, rmin, rdelta, nstep)
        scales.append(sc); mins.append(m); L += l
        if sc > max_scale: max_scale = sc
        if m > max_min: max_min = m
    inv_s = f(f(63) / max_scale) if max_scale > 0 else f(0)
    inv_m = f(f(63) / max_min) if max_min > 0 else f(0)
    sb = [0] * 12; ls_all = []; lm_all = []
    for j in range(8):
        ls = min(63, nearest_int(f(inv_s * scales[j])) & 0xFF); lm = min(63, nearest_int(f(inv_m * mins[j])) & 0xFF)
        ls_all.append(ls); lm_all.append(lm)
        if j < 4:
            sb[j] = ls; sb[j + 4] = lm
        else:
            sb[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4); sb[j - 4] |= (ls >> 4) << 6; sb[j] |= (lm >> 4) << 6
    d16 = np.float16(f(max_scale / f(63))); dm16 = np.float16(f(max_min / f(63)))
    for j in range(8):
        d = f(f(d16) * f(ls_all[j]))
        if d == 0: continue
        dm = f(f(dm16) * f(lm_all[j]))
        for ii in range(32):
            L[32 * j + ii] = max(0, min(nmax, nearest_int(f(f(x[32 * j + ii] + dm) / d))))
    return d16, dm16, sb, L

def q4k(x):
    d, dm, sb, L = q45k_block(x, 15, -1.0, 0.1, 20)
    qs = []
    for j in range(0, 256, 64):
        qs += [L[j + l] | (L[j + l + 32] << 4) for l in range(32)]
    return np.array([d, dm], "<f2").tobytes() + bytes(sb) + bytes(qs)

def q5k(x):
    d, dm, sb, L = q45k_block(x, 31, -0.5, 0.1, 15)
    qh = [0] * 32; ql = []
    m1, m2 = 1, 2
    for n in range(0, 256, 64):
        for j in range(32):
            l1 = L[n + j]; l2 = L[n + j + 32]
            if l1 > 15: l1 -= 16; qh[j] |= m1
            if l2 > 15: l2 -= 16; qh[j] |= m2
            ql.append(l1 | (l2 << 4))
        m1 <<= 2; m2 <<= 2
    return np.array([d, dm], "<f2").tobytes() + bytes(sb) + bytes(qh) + bytes(ql)

def make_qx(x, nmax):
    n = len(x); mx = f(0); amax = f(0)
    for v in x:
        if abs(v) > amax: amax = abs(v); mx = v
    if amax < f(1e-15): return f(0), [0] * n
    iscale = f(f(-nmax) / mx)
    sumlx = suml2 = f(0); L = [0] * n
    for i in range(n):
        l = max(-nmax, min(nmax - 1, nearest_int(f(iscale * x[i])))); L[i] = l + nmax
        w = f(x[i] * x[i])
        sumlx = f(sumlx + f(f(w * x[i]) * f(l))); suml2 = f(suml2 + f(f(w * f(l)) * f(l)))
    scale = f(sumlx / suml2) if suml2 else f(0)
    best = f(scale * sumlx)
    for st in range(-9, 10):
        if st == 0: continue
        iscale = f(-f(f(nmax) + f(f(0.1) * f(st))) / mx)
        sumlx = suml2 = f(0)
        for i in range(n):
            l = max(-nmax, min(nmax - 1, nearest_int(f(iscale * x[i]))))
            w = f(x[i] * x[i])
            sumlx = f(sumlx + f(f(w * x[i]) * f(l))); suml2 = f(suml2 + f(f(w * f(l)) * f(l)))
        if suml2 > 0 and f(sumlx * sumlx) > f(best * suml2):
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, nearest_int(f(iscale * x[i]))))
            scale = f(sumlx / suml2); best = f(scale * sumlx)
    return scale, L

def q6k(x):
    L = []; scales = []; max_scale = f(0); max_abs = f(0)
    for ib in range(16):
        sc, l = make_qx(x[16 * ib:16 * ib + 16], 32); scales.append(sc); L += l
        if abs(sc) > max_abs: max_abs = abs(sc); max_scale = sc
    if max_abs < f(1e-15): return bytes(210)
    iscale = f(f(-128) / max_scale)
    d16 = np.float16(f(f(1) / iscale))
    sc8 = [min(127, nearest_int(f(iscale * s))) for s in scales]
    for j in range(16):
        d = f(f(d16) * f(sc8[j]))
        if d == 0: continue
        for ii in range(16):
            L[16 * j + ii] = max(-32, min(31, nearest_int(f(x[16 * j + ii] / d)))) + 32
    ql = [0] * 128; qh = [0] * 64
    for h, j in enumerate(range(0, 256, 128)):
        for l in range(32):
            q1, q2, q3, q4 = (L[j + l + 32 * k] for k in range(4))
            ql[64 * h + l] = (q1 & 0xF) | ((q3 & 0xF) << 4); ql[64 * h + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4)
            qh[32 * h + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
    return bytes(ql) + bytes(qh) + np.array(sc8, np.int8).tobytes() + np.array([d16], "<f2").tobytes()
