#!/usr/bin/env bash
# GPU check of kvmem's device path (issue 9), one prepared run, under 5 minutes on an H200 (12 with step 6):
#   1. the cuda-marked tests: every Triton kernel bit-for-bit against its torch reference;
#   2. H2D / D2H GB/s of kvmem's staged page copies, and of GpuTier put/get, vs a plain pinned copy_ of the
#      same bytes (goal >= 0.8);
#   3. kernel times vs their torch references (gather, scatter, int8/int4 quantize, fused dequantize+scatter);
#   4. TTFT kvmem / oracle with the model on the GPU (chunks in the CPU tier, oracle: prefix cache on the GPU);
#   4b. BlendCache (documents reused in another order, 15 % recomputed) vs a full prefill on the GPU;
#   5. bench_store.py --quick and bench_ttft.py --quick (the CPU-side tables, for the record);
#   6. bench_serving.py --quick on CUDA vLLM, when the python given has it (up to 7 more minutes).
# Usage (repository root): bash benchmarks/gpu_check.sh [python]
set -uo pipefail  # NOTE: not -e: one failed step is reported and the others still run (device time is scarce)
PY="${1:-python}"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PY" - <<'EOF' || exit 1
import torch, sys
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device visible to torch; nothing to check")
print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
EOF

echo "== 1. cuda-marked tests =="
timeout 150 "$PY" -m pytest tests/cuda -q -m cuda -p no:randomly -p no:cacheprovider || echo "gpu_check: step 1 FAILED"

echo "== 2-4. transfers, kernels, TTFT on the GPU =="
timeout 180 "$PY" - <<'EOF' || echo "gpu_check: steps 2-4 FAILED"
import copy, statistics, tempfile, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import kvmem
from kvmem import cuda
from kvmem.cuda import reference, triton_ops
from kvmem.cuda.kvquant import quantize_kv
from kvmem.codecs.quant import QuantCodec
from kvmem.kv import PrefixCache
from kvmem.stores.paged import PagedBuffer

dev = torch.device("cuda")
assert cuda.ACCELERATED, "Triton kernels were not selected"


def timed(fn, repeat=20):
    fn(); torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter(); fn(); torch.cuda.synchronize(); times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- 2. transfers: 1024 pages of 64 KiB (64 MiB), coalesced into 1 MiB copies through staging buffers --
PAGE, N, RUN = 64 * 1024, 1024, 16
pages = PagedBuffer(N, 1, PAGE, torch.uint8, dev)
host = torch.randint(0, 255, (N, PAGE), dtype=torch.uint8).pin_memory()
ids = torch.randperm(N, device=dev)
host_staging = [torch.empty(1, RUN * PAGE, dtype=torch.uint8).pin_memory() for _ in range(2)]
dev_staging = [torch.empty(1, RUN * PAGE, dtype=torch.uint8, device=dev) for _ in range(2)]
side = torch.cuda.Stream()


def kvmem_h2d():  # host runs -> device staging (side stream) -> scatter into scattered pages
    with torch.cuda.stream(side):
        for i in range(0, N, RUN):
            s = (i // RUN) % 2
            dev_staging[s].copy_(host[i:i + RUN].view(1, -1), non_blocking=True)
            cuda.scatter_pages(pages.pages, ids[i:i + RUN], dev_staging[s])
    torch.cuda.current_stream().wait_stream(side)


out = torch.empty(N, PAGE, dtype=torch.uint8).pin_memory()


def kvmem_d2h():  # gather scattered pages into device staging -> one 1 MiB copy per run into pinned host
    with torch.cuda.stream(side):
        for i in range(0, N, RUN):
            s = (i // RUN) % 2
            dev_staging[s].copy_(cuda.gather_pages(pages.pages, ids[i:i + RUN]))
            out[i:i + RUN].view(1, -1).copy_(dev_staging[s], non_blocking=True)
    torch.cuda.current_stream().wait_stream(side)


flat = torch.empty(N, PAGE, dtype=torch.uint8, device=dev)
plain_h2d = lambda: flat.copy_(host, non_blocking=True)
plain_d2h = lambda: out.copy_(flat, non_blocking=True)
kvmem_h2d(); torch.cuda.synchronize()
kvmem_d2h(); torch.cuda.synchronize()
assert torch.equal(out, host), "pages did not round-trip"
nbytes = N * PAGE
for name, mine, plain in (("H2D", kvmem_h2d, plain_h2d), ("D2H", kvmem_d2h, plain_d2h)):
    a, b = timed(mine, 10), timed(plain, 10)
    print(f"{name}: kvmem {nbytes / a / 1e9:6.1f} GB/s  plain pinned copy_ {nbytes / b / 1e9:6.1f} GB/s  "
          f"ratio {b / a:.2f} (goal >= 0.8)")

# -- 2b. the GPU tier itself: a 32 MiB blob put (host parts -> staging -> pages) and get (+ D2H) --------------
from kvmem import blob as blobfmt
from kvmem.stores import GpuTier
payload = torch.randint(0, 255, (32 << 20,), dtype=torch.uint8)
blob = blobfmt.encode({"kind": "gpu_check"}, [payload.numpy()])  # the host parts a CPU-tier entry hands over
BLOB = blob.nbytes
tier = GpuTier(256 << 20)
src = torch.cat([torch.from_numpy(p.copy()) for p in blob.parts]).pin_memory()  # the same bytes, one pinned run
key = "ab" * 32
dev_blob = torch.empty(BLOB, dtype=torch.uint8, device=dev)
back = torch.empty(BLOB, dtype=torch.uint8).pin_memory()
tier.put(key, blob)
assert torch.equal(tier.get(key).cpu(), src), "GpuTier did not round-trip"
from kvmem.stores import CpuTier
cpu_tier = CpuTier(128 << 20)  # its pool is pinned when CUDA is present
cpu_tier.put(key, blob)
lent = cpu_tier.blob(key)  # what a promotion from the CPU tier hands the GPU tier
tier.put(key, lent)
assert torch.equal(tier.get(key).cpu(), src), "GpuTier did not round-trip the CPU tier's pages"
rows_2b = (("GpuTier put (pageable parts)", lambda: tier.put(key, blob), lambda: dev_blob.copy_(src, non_blocking=True)),
           ("GpuTier put (CPU-tier pages)", lambda: tier.put(key, lent), lambda: dev_blob.copy_(src, non_blocking=True)),
           ("GpuTier get + D2H", lambda: back.copy_(tier.get(key)), lambda: back.copy_(dev_blob)))
for name, mine, plain in rows_2b:
    a, b = timed(mine, 10), timed(plain, 10)
    print(f"{name}: kvmem {BLOB / a / 1e9:6.1f} GB/s  plain pinned copy_ {BLOB / b / 1e9:6.1f} GB/s  "
          f"ratio {b / a:.2f} (goal >= 0.8)")
del tier, lent, cpu_tier

# -- 3. kernels vs torch references -----------------------------------------------------------------
kv = (torch.randn(1, 8, 256, 128, device=dev) * 3).bfloat16()
kpages = torch.randn(4096, 16, 256 * 128 // 16, device=dev).bfloat16()
kids = torch.randperm(4096, device=dev)[:256]
ksrc = reference.gather_pages(kpages, kids)
parts, meta = QuantCodec(8, 64).encode(kv, -2)
parts4, meta4 = QuantCodec(4, 64).encode(kv, -1)
dst = torch.empty(1, 8, 4096, 128, device=dev, dtype=torch.bfloat16)
rows = [
    ("gather 256 pages", lambda: triton_ops.gather_pages(kpages, kids), lambda: reference.gather_pages(kpages, kids)),
    ("scatter 256 pages", lambda: triton_ops.scatter_pages(kpages, kids, ksrc),
     lambda: reference.scatter_pages(kpages, kids, ksrc)),
    ("int8 quantize (keys)", lambda: quantize_kv(kv, 8, 64, -2), lambda: QuantCodec(8, 64).encode(kv, -2)),
    ("int4 quantize (values)", lambda: quantize_kv(kv, 4, 64, -1), lambda: QuantCodec(4, 64).encode(kv, -1)),
    ("int8 dequant+scatter", lambda: triton_ops.dequantize_into(dst, 512, parts["q"], parts["step"], parts["lo"], 8, -2, 256),
     lambda: reference.dequantize_into(dst, 512, parts["q"], parts["step"], parts["lo"], 8, -2, 256)),
    ("int4 dequant+scatter", lambda: triton_ops.dequantize_into(dst, 512, parts4["q"], parts4["step"], parts4["lo"], 4, -1, 128),
     lambda: reference.dequantize_into(dst, 512, parts4["q"], parts4["step"], parts4["lo"], 4, -1, 128)),
]
for name, fast, ref in rows:
    a, b = timed(fast), timed(ref)
    print(f"kernel {name:<24} triton {a * 1e6:8.1f} us  torch reference {b * 1e6:8.1f} us  speed-up {b / a:5.2f}x")

# -- 4. TTFT kvmem / oracle on the GPU -----------------------------------------------------------------
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=8192)
model = LlamaForCausalLM(cfg).to(dev, torch.bfloat16).eval()
with tempfile.TemporaryDirectory() as tmp:
    mem = kvmem.Memory(tmp, cpu_bytes="4GiB", disk_bytes=0)
    pc = PrefixCache(model, mem, block_size=256, compression="none")
    for length in (2048, 4096):
        g = torch.Generator().manual_seed(length)
        prefix = torch.randint(3, 32000, (1, length), generator=g)
        pc.prefill(prefix); pc.flush()
        with torch.no_grad():
            base = model(prefix.to(dev), use_cache=True).past_key_values
        ratios = []
        for rep in range(5):
            suffix = torch.randint(3, 32000, (1, 256), generator=g)
            ids = torch.cat([prefix, suffix], 1)

            def oracle():
                with torch.no_grad():
                    model(suffix.to(dev), past_key_values=copy.deepcopy(base), use_cache=True, logits_to_keep=1)

            def mine():
                pc.prefill(ids, logits_to_keep=1)

            t_o, t_k = timed(oracle, 1), timed(mine, 1)
            pc.flush()
            ratios.append(t_k / t_o)
        print(f"TTFT {length}+256 tokens (250m bf16, chunks in the CPU tier): kvmem/oracle "
              f"{statistics.median(ratios):.2f}")
    pc.close(); mem.close()

# -- 4b. BlendCache on the GPU: 4 documents of 1,024 tokens in another order, 15 % recomputed (issue 19) ----------
from kvmem.kv import BlendCache, Segment
g = torch.Generator().manual_seed(7)
docs = [Segment(torch.randint(3, 32000, (1024,), generator=g)) for _ in range(4)]
system = Segment(torch.randint(3, 32000, (64,), generator=g), reusable=False)
question = Segment(torch.randint(3, 32000, (32,), generator=g), reusable=False)
segments = [system, *docs, question]
ids = torch.cat([s.tokens for s in segments])[None].to(dev)
with tempfile.TemporaryDirectory() as tmp:
    mem = kvmem.Memory(tmp, cpu_bytes="4GiB", disk_bytes=0)
    bc = BlendCache(model, mem, compression="none")
    bc.prefill([system, *docs[::-1], question]); bc.flush()  # the documents stored in another order


    def full():
        with torch.no_grad():
            model(ids, use_cache=True, logits_to_keep=1)


    blend = lambda: bc.prefill(segments, recompute_ratio=0.15)
    t_full, t_blend = timed(full, 5), timed(blend, 5)
    print(f"blend 4x1024 tokens, 15 % recomputed (250m bf16): full prefill {t_full * 1e3:.1f} ms, "
          f"blend {t_blend * 1e3:.1f} ms (speed-up {t_full / t_blend:.2f}x)")
    bc.close(); mem.close()
EOF

echo "== 5. bench_store.py --quick, bench_ttft.py --quick =="
timeout 60 "$PY" benchmarks/bench_store.py --quick || echo "gpu_check: bench_store FAILED"
timeout 120 "$PY" benchmarks/bench_ttft.py --quick --plot /tmp/kvmem-gpu-check-ttft.png || echo "gpu_check: bench_ttft FAILED"
echo "== 6. bench_serving.py --quick with CUDA vLLM (issue 18), where this python has it =="
if "$PY" -c "import torch, vllm, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    timeout 420 "$PY" benchmarks/bench_serving.py --quick --device cuda || echo "bench_serving: failed or timed out"
else
    echo "no CUDA build of vLLM importable by $PY: the serving benchmark was not run on the GPU"
fi
echo "gpu_check: done"
