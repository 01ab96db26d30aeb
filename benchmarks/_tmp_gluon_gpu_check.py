import sys, os, math, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import torch
import triton
from tplogp.kernels import gluon_sm90 as gk

print("triton", triton.__version__, "torch", torch.__version__, gk.available())


def ref_stats(h, w, b, tgt, inv_t):
    z = (h.double() @ w.double().T + (b.double() if b is not None else 0)) * inv_t
    M = z.max(1).values
    e = torch.exp(z - M[:, None])
    S = e.sum(1)
    Q = (e * (z - M[:, None])).sum(1)
    V = w.shape[0]
    own = (tgt >= 0) & (tgt < V)
    T = torch.where(own, z.gather(1, tgt.clamp(0, V - 1)[:, None])[:, 0], torch.zeros_like(M))
    return M, S, T, Q


def fold(parts, with_entropy):
    m, s, t = parts[0].double(), parts[1].double(), parts[2].double()
    M = m.max(0).values
    d = torch.where(m == -math.inf, torch.full_like(m, -math.inf), m - M)
    wgt = torch.exp(d)
    S = (wgt * s).sum(0)
    T = t.sum(0)
    Q = None
    if with_entropy:
        q = parts[3].double()
        Q = (wgt * (q + torch.where(s == 0, torch.zeros_like(d), d * s))).sum(0)
    return M, S, T, Q


def check(n, d, v, has_bias, with_entropy, dtype, sms=None, inv_t=1 / 0.7):
    torch.manual_seed(n + d + v)
    h = (torch.randn(n, d, device="cuda") * 0.5).to(dtype)
    w = (torch.randn(v, d, device="cuda") * 0.5).to(dtype)
    b = torch.randn(v, device="cuda") if has_bias else None
    tgt = torch.randint(-1, v, (n,), device="cuda", dtype=torch.int64)
    cfg = gk.PingPongConfig()
    S = -(-v // cfg.split_v)
    parts = torch.full(gk.parts_shape(n, S, with_entropy), float("nan"), device="cuda")
    if sms is not None:
        gk._SM_COUNT[0] = sms
    else:
        gk._SM_COUNT.pop(0, None)
    gk.launch_stats_pingpong(h, w, b, tgt, parts, S, cfg.split_v, inv_t, with_entropy, cfg)
    torch.cuda.synchronize()
    M, Sm, T, Q = fold(parts, with_entropy)
    rM, rS, rT, rQ = ref_stats(h, w, b, tgt, inv_t)
    errs = [((M - rM).abs() / rM.abs().clamp_min(1)).max().item(), ((Sm - rS).abs() / rS).max().item(),
            ((T - rT).abs() / rT.abs().clamp_min(1)).max().item()]
    if with_entropy:
        errs.append(((Q - rQ).abs() / rQ.abs().clamp_min(1e-3)).max().item())
    logp = (T - M) - torch.log(Sm)
    rlogp = (rT - rM) - torch.log(rS)
    own = (tgt >= 0)
    errs.append(((logp - rlogp).abs() / rlogp.abs().clamp_min(1))[own].max().item())
    bad = any(not (e < 1e-5) for e in errs) or torch.isnan(parts).any().item()
    print(f"{'BAD' if bad else 'ok '} n={n} d={d} v={v} bias={has_bias} ent={with_entropy} {dtype} sms={sms} "
          f"errs(M,S,T,[Q],logp)={['%.2e' % e for e in errs]}", flush=True)
    return not bad


ok = True
for sms in (None, 1, 3):
    ok &= check(300, 200, 2048 + 300, True, True, torch.bfloat16, sms)
    ok &= check(300, 192, 2048 + 100, False, True, torch.float16, sms)
    ok &= check(257, 128, 1024 * 3, True, False, torch.bfloat16, sms)
    ok &= check(128, 64, 128, False, False, torch.bfloat16, sms)
ok &= check(6400, 256, 5000, True, True, torch.bfloat16, None)
print("ALL OK" if ok else "SOME BAD", flush=True)

if ok and "--bench" in sys.argv:
    n, d, v = 4096, 2048, 131072
    h = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(v, d, device="cuda", dtype=torch.bfloat16) * 0.02
    tgt = torch.randint(0, v, (n,), device="cuda")
    cfg = gk.PingPongConfig()
    S = -(-v // cfg.split_v)
    gk._SM_COUNT.pop(0, None)
    for ent in (False, True):
        parts = torch.empty(gk.parts_shape(n, S, ent), device="cuda")
        f = lambda: gk.launch_stats_pingpong(h, w, None, tgt, parts, S, cfg.split_v, 1.0, ent, cfg)
        g = lambda: h @ w.T
        t_k = triton.testing.do_bench(f, warmup=50, rep=300)
        t_g = triton.testing.do_bench(g, warmup=50, rep=300)
        print(f"entropy={ent}: pingpong {t_k:.3f} ms, torch GEMM {t_g:.3f} ms, ratio {t_k / t_g:.3f}, "
              f"{2 * n * d * v / t_k / 1e9:.0f} TFLOP/s", flush=True)
