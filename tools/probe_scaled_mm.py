"""One-off capability probe: which torch._scaled_mm / grouped-mm recipes this GPU + torch accept."""
import torch, itertools, traceback, inspect
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())
dev = "cuda"
M, N, K = 256, 512, 384
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
def q(x, dt):
    return x.clamp(-400, 400).to(dt)
a = torch.randn(M, K, device=dev); b = torch.randn(N, K, device=dev)
ref = a @ b.t()
def tryit(name, fn):
    try:
        out = fn()
        torch.cuda.synchronize()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        print(f"OK   {name}: relerr={err:.3e} dtype={out.dtype}")
    except Exception as e:
        print(f"FAIL {name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
one = torch.tensor(1.0, device=dev)
for da, db in itertools.product([E4, E5], [E4, E5]):
    for od in [torch.bfloat16, torch.float16, torch.float32]:
        tryit(f"tensorwise {da}x{db} out={od}", lambda: torch._scaled_mm(q(a, da), q(b, db).t(), one, one, out_dtype=od))
for da, db in itertools.product([E4, E5], [E4, E5]):
    for od in [torch.bfloat16, torch.float32]:
        sa = torch.ones(M, 1, device=dev); sb = torch.ones(1, N, device=dev)
        tryit(f"rowwise {da}x{db} out={od}", lambda: torch._scaled_mm(q(a, da), q(b, db).t(), sa, sb, out_dtype=od))
# blockwise 1x128 x 128x128
try:
    from torch.nn.functional import ScalingType, SwizzleType
    print("ScalingType", list(ScalingType))
    print(inspect.signature(torch.nn.functional.scaled_mm))
except Exception as e:
    print("no F.scaled_mm", e)
sa = torch.ones(M, K // 128, device=dev)
sb = torch.ones(N // 128, K // 128, device=dev)
tryit("blockwise legacy rowmajor scales", lambda: torch._scaled_mm(q(a, E4), q(b, E4).t(), sa, sb, out_dtype=torch.bfloat16))
tryit("blockwise legacy outer-major a scale", lambda: torch._scaled_mm(q(a, E4), q(b, E4).t(), sa.t().contiguous().t(), sb, out_dtype=torch.bfloat16))
tryit("blockwise legacy outer-major both", lambda: torch._scaled_mm(q(a, E4), q(b, E4).t(), sa.t().contiguous().t(), sb.t().contiguous().t(), out_dtype=torch.bfloat16))
try:
    from torch.nn.functional import scaled_mm, ScalingType, SwizzleType
    for sal in ["row", "outer"]:
        for sbl in ["row", "outer"]:
            def f():
                sa_ = sa if sal == "row" else sa.t().contiguous().t()
                sb_ = sb if sbl == "row" else sb.t().contiguous().t()
                return scaled_mm(q(a, E4), q(b, E4).t(), sa_, ScalingType.BlockWise1x128, sb_, ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
            tryit(f"F.scaled_mm blockwise a={sal} b={sbl}", f)
    sbb = torch.ones(N, K // 128, device=dev)
    tryit("F.scaled_mm 1x128 x 1x128 outer", lambda: scaled_mm(q(a, E4), q(b, E4).t(), sa.t().contiguous().t(), ScalingType.BlockWise1x128, sbb.t().contiguous().t(), ScalingType.BlockWise1x128, output_dtype=torch.bfloat16))
    tryit("F.scaled_mm 1x128 x 1x128 row", lambda: scaled_mm(q(a, E4), q(b, E4).t(), sa, ScalingType.BlockWise1x128, sbb, ScalingType.BlockWise1x128, output_dtype=torch.bfloat16))
    tryit("F.scaled_mm blockwise e5m2 a", lambda: scaled_mm(q(a, E5), q(b, E4).t(), sa.t().contiguous().t(), ScalingType.BlockWise1x128, sb, ScalingType.BlockWise128x128, output_dtype=torch.bfloat16))
    tryit("F.scaled_mm rowwise e5 x e4", lambda: scaled_mm(q(a, E5), q(b, E4).t(), torch.ones(M,1,device=dev), ScalingType.RowWise, torch.ones(1,N,device=dev), ScalingType.RowWise, output_dtype=torch.bfloat16))
    e8 = getattr(torch, "float8_e8m0fnu", None)
    tryit("F.scaled_mm MX", lambda: scaled_mm(q(a, E4), q(b, E4).t(), torch.ones(M, K//32, device=dev).to(e8), ScalingType.BlockWise1x32, torch.ones(N, K//32, device=dev).to(e8), ScalingType.BlockWise1x32, swizzle_a=SwizzleType.SWIZZLE_32_4_4, swizzle_b=SwizzleType.SWIZZLE_32_4_4, output_dtype=torch.bfloat16))
except Exception as e:
    traceback.print_exc()
# odd K for tensorwise
a2 = torch.randn(M, 100, device=dev); b2 = torch.randn(N, 100, device=dev)
try:
    torch._scaled_mm(q(a2, E4), q(b2, E4).t(), one, one, out_dtype=torch.bfloat16); print("OK K=100 tensorwise")
except Exception as e: print("FAIL K=100:", str(e).splitlines()[0][:200])
a3 = torch.randn(1, K, device=dev)
try:
    torch._scaled_mm(q(a3, E4), q(b, E4).t(), one, one, out_dtype=torch.bfloat16); print("OK M=1 tensorwise")
except Exception as e: print("FAIL M=1:", str(e).splitlines()[0][:200])
# grouped
G = 4
offs = torch.tensor([64, 64, 192, 256], device=dev, dtype=torch.int32)
A = torch.randn(M, K, device=dev, dtype=torch.bfloat16); B = torch.randn(G, N, K, device=dev, dtype=torch.bfloat16)
try:
    o = torch._grouped_mm(A, B.transpose(-2, -1), offs=offs); torch.cuda.synchronize(); print("OK _grouped_mm", o.shape)
except Exception as e: print("FAIL _grouped_mm", str(e).splitlines()[0][:200])
try:
    print(inspect.signature(torch._scaled_grouped_mm) if hasattr(torch, "_scaled_grouped_mm") else "no _scaled_grouped_mm")
    o = torch._scaled_grouped_mm(A.float().clamp(-400,400).to(E4), B.float().clamp(-400,400).to(E4).transpose(-2,-1), torch.ones(M, device=dev), torch.ones(G, N, device=dev), offs=offs, out_dtype=torch.bfloat16)
    torch.cuda.synchronize(); print("OK _scaled_grouped_mm rowwise", o.shape)
except Exception as e: print("FAIL _scaled_grouped_mm", str(e).splitlines()[0][:300])
print("cudnn", torch.backends.cudnn.version())
