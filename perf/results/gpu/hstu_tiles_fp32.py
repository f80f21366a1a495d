"""One-off check run on the H200 after perf/gpu_run.sh at b167d20 showed the fp32 encoder slower than
before: the HSTU kernel per tile shape (BLOCK_M x BLOCK_N x warps x stages) in fp32 and fp16 at the
caching benchmark's encode shape (256 users x 512 rows, 2 heads of 32) and a ranking shape (64 users,
128 candidates), beside the kernels of commit 6cb4393 ("old"); medians of 20 CUDA-event timings, L2
not flushed; err = max |difference| to the old kernel. Its output: hstu_tiles_fp32.txt. To rerun it
from the repository root on a GPU host:
    mkdir -p gpu_baseline && git show 6cb4393:backend_src/ops/triton_kernels.py > gpu_baseline/triton_kernels_at_6cb4393.py
    python3 perf/results/gpu/hstu_tiles_fp32.py
(SMOKE=1 runs tiny shapes through Triton's CPU interpreter; its timings mean nothing.)
"""
import importlib.util, sys, time, os, statistics
SMOKE = bool(os.environ.get('SMOKE'))
if SMOKE: os.environ['TRITON_INTERPRET'] = '1'
import torch
sys.path.insert(0, '.')
from backend_src.ops import triton_kernels as K, reference as R
spec = importlib.util.spec_from_file_location("old", "gpu_baseline/triton_kernels_at_6cb4393.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
dev = 'cpu' if SMOKE else 'cuda'
def timeit(fn, reps=20):
    if SMOKE: fn(); return 0.0
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    return statistics.median(ts)
for dtype in (torch.float32, torch.float16):
  for B, H, d, N, M in ([(2, 2, 16, 40, 0), (2, 2, 16, 40, 5)] if SMOKE else [(256, 2, 32, 512, 0), (64, 2, 32, 512, 128)]):
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: (torch.randn(*s, generator=g, device=dev) * 0.5).to(dtype)
    nh = torch.full((B,), N, dtype=torch.long, device=dev)
    pos = torch.arange(N, device=dev)[None].expand(B, N)
    ts = torch.cumsum(torch.randint(0, 3 * 86400, (B, N), generator=g, device=dev), 1)
    pb = (torch.randn(H, N, generator=g, device=dev) * 0.1).to(dtype); tb = (torch.randn(H, 64, generator=g, device=dev) * 0.1).to(dtype)
    if M == 0:
        q, k, v = rnd(B, N, H, d), rnd(B, N, H, d), rnd(B, N, H, d)
        a = (q, k, v, pos, pos, ts, ts, nh, torch.full((B, N), -1, device=dev))
    else:
        q, k, v = rnd(B, M, H, d), rnd(B, N + M, H, d), rnd(B, N + M, H, d)
        k_pos = torch.cat([pos, nh[:, None].expand(B, M)], 1); k_ts = torch.cat([ts, ts[:, -1:].expand(B, M)], 1)
        a = (q, k, v, nh[:, None].expand(B, M), k_pos, ts[:, -1:].expand(B, M), k_ts, nh, (N + torch.arange(M, device=dev))[None].expand(B, M))
    extra = (pb, tb, 1.6, d ** -0.5, float(N))
    ref = old.hstu_attention(*a, *extra)
    row = [f"{str(dtype)[6:]} {B}x{H}x{d}x{N}+{M}: old {timeit(lambda: old.hstu_attention(*a, *extra)):.3f}"]
    for tile in [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 1), (64, 32, 4, 2), (64, 32, 4, 1), (32, 32, 4, 2), (32, 64, 4, 2), (16, 32, 4, 2)]:
        try:
            out = K._launch_hstu(*a, *extra, tiles=tile)
            err = float((out.float() - ref.float()).abs().max())
            row.append(f"{'x'.join(map(str, tile))} {timeit(lambda: K._launch_hstu(*a, *extra, tiles=tile)):.3f} (err {err:.1e})")
        except Exception as exc:
            row.append(f"{tile} ERR {str(exc)[:80]}")
    print(" | ".join(row), flush=True)
