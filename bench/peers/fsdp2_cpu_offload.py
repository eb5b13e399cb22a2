"""FSDP2 peer of offload-bench: PyTorch FSDP2 fully_shard + CPUOffloadPolicy(pin_memory=True), G ranks.

Measures s/step (per rank and max over ranks; median and min-max of the timed steps; a step = one forward,
batch 1, on every rank) of exactly offload-bench's DiT proxy (bench/src/main.rs): Flux.1-dev's tensors,
23,803,996,288 bytes; one GEMM [tokens, in] x [out, in]^T per 2-D bf16 weight, two attention-sized batched
GEMMs per block (24 heads x tokens^2 x 128: the bench's `--attention materialized`; its default is a fused
kernel of the same FLOPs), every weight byte folded: 124.5 TFLOP at 4608 tokens, 602.0 at
16896. Rows map to the bench's: `fsdp2 cpu offload` ~ `layerwise`, `resident` = compute floor, limit =
max(resident, streamed bytes / (G x pinned H2D GB/s)), `above scratch` ~ peak device weight bytes.

Launch (two GPUs of one host; NCCL_NVLS_ENABLE defaults to 0):
  torchrun --standalone --nproc_per_node=2 bench/peers/fsdp2_cpu_offload.py \
      --tokens 4608 16896 --steps 5 --warmup 2 --json fsdp2.json
  offload-launch -n 2 -- python3 bench/peers/fsdp2_cpu_offload.py --tokens 4608 16896 --json fsdp2.json
Any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT works; started bare it
runs one rank. Each GPU needs the proxy's scratch (14.3 GB at 16896 tokens) and, for the resident run
(skip it with --no-resident), the whole model (23.8 GB) besides. Rank 0 prints a table and, with --json,
writes JSON; the exit status is 1 if the ranks' outputs disagree or differ from the resident run's.
--describe prints the model (bytes, GEMMs, FLOPs/step) and, when launched with ranks, each rank's shard
bytes, all on the meta device (no GPU). --tiny --device cpu is the CPU smoke test (gloo, no pinning).
"""

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import time

# NCCL reads this when the communicator is created: set it before torch can.
# NVLink SHARP (multicast) must stay off on the lent machines.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

try:
    import torch
    import torch.distributed as dist
    from torch import nn
except ImportError as e:  # pragma: no cover - depends on the machine
    print(f"fsdp2_cpu_offload: PyTorch is not importable ({e}); install torch >= 2.4 "
          "(the peers were measured with 2.11)", file=sys.stderr)
    sys.exit(2)

try:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
except ImportError:
    try:  # PyTorch 2.4-2.5 kept FSDP2 here
        from torch.distributed._composable.fsdp import CPUOffloadPolicy, fully_shard
    except ImportError as e:
        print(f"fsdp2_cpu_offload: FSDP2 (fully_shard, CPUOffloadPolicy) is missing from torch "
              f"{torch.__version__} ({e})", file=sys.stderr)
        sys.exit(2)

try:
    from torch.distributed.device_mesh import init_device_mesh
except ImportError as e:
    print(f"fsdp2_cpu_offload: torch {torch.__version__} has no DeviceMesh ({e})", file=sys.stderr)
    sys.exit(2)

# offload-bench's figures for its `flux1_dev_dit()` (offload-sim presets): every storage's bytes, the
# bytes layerwise streams (the 57 blocks), the largest block. The full-size model here must equal them.
BENCH_WEIGHT_BYTES = 23_803_996_288
BENCH_STREAMED_BYTES = 23_674_566_656
BENCH_LARGEST_BLOCK_BYTES = 679_662_592

MAX_TOKENS = 1 << 20
MAX_STEPS = 1000
MAX_WARMUP = 100
# Activations the chain step rewrites after each block (offload-cuda proxy's CHAIN_ELEMENTS).
CHAIN_ELEMENTS = 16384
# Device memory kept free beside weights and scratch (as the bench's HEADROOM_BYTES).
HEADROOM_BYTES = 4 << 30
# The chain state's modulus (a prime below 2^31: state * multiplier stays inside int64).
STATE_MOD = 2_147_483_647
STATE_MUL = 1_000_003
# Period of the deterministic weight pattern (a prime, so rows do not repeat it in step).
TILE = 65_521


class Config:
    """The DiT's dimensions: Flux.1-dev (the bench's), or a tiny one of the same structure."""

    def __init__(self, tiny: bool):
        if tiny:
            self.d, self.ff, self.heads, self.head_dim = 64, 256, 2, 32
            self.in_ch, self.ctx, self.time, self.pooled = 16, 128, 16, 32
            self.freqs, self.double, self.single = (16, 8), 3, 4
        else:
            self.d, self.ff, self.heads, self.head_dim = 3072, 12288, 24, 128
            self.in_ch, self.ctx, self.time, self.pooled = 64, 4096, 256, 768
            self.freqs, self.double, self.single = (4608, 64), 19, 38
        self.tiny = tiny


# ----------------------------------------------------------------------------------------------
# The model: the bench's tensors (names, shapes, dtypes, order), its compute proxy as forward.
# ----------------------------------------------------------------------------------------------


class Node(nn.Module):
    """A container, so that tensors get the bench's dotted names (attn.to_out.0.weight ...)."""


class Linear(nn.Module):
    """A bf16 [out, in] weight (and bias): Y[tokens, out] = X[tokens, in] . W^T, as the proxy's linear."""

    def __init__(self, out_f: int, in_f: int, bias: bool = True):
        super().__init__()
        self.out_f, self.in_f = out_f, in_f
        self.weight = nn.Parameter(torch.empty(out_f, in_f, dtype=torch.bfloat16))
        self.bias = nn.Parameter(torch.empty(out_f, dtype=torch.bfloat16)) if bias else None


class RMSNorm(nn.Module):
    """An RMS norm's weight: folded, no GEMM (the bench folds 1-D tensors only)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.bfloat16))


def _put(root: nn.Module, path: str, module: nn.Module) -> None:
    *parents, leaf = path.split(".")
    at = root
    for p in parents:
        if not hasattr(at, p):
            at.add_module(p, Node())
        at = getattr(at, p)
    at.add_module(leaf, module)


class Unit(nn.Module):
    """A module whose forward is the proxy over its own tensors: the root (its tensors outside the
    blocks) or one block. `order` lists its Linear and RMSNorm modules in the bench's tensor order."""

    def __init__(self):
        super().__init__()
        self.__dict__["order"] = []  # plain list: not a second registration of the children

    def linear(self, path: str, out_f: int, in_f: int, bias: bool = True) -> None:
        m = Linear(out_f, in_f, bias)
        _put(self, path, m)
        self.order.append(m)

    def rms(self, path: str, dim: int) -> None:
        m = RMSNorm(dim)
        _put(self, path, m)
        self.order.append(m)

    def own_kernels(self, proxy: "Proxy", tokens: int, extra=()) -> None:
        # As the bench's `kernels`: a GEMM per 2-D bf16 weight at its real shape, and every tensor's
        # bytes folded (here batched: one row sum per 2-D tensor, one fold for the unit).
        two_d, one_d = [], []
        for m in self.order:
            if isinstance(m, Linear):
                proxy.linear(m.weight, tokens)
                two_d.append(m.weight)
                if m.bias is not None:
                    one_d.append(m.bias)
            else:
                one_d.append(m.weight)
        proxy.fold(two_d + list(extra), one_d)


def dual_stream_block(cfg: Config) -> "Block":
    """Flux's double block: as offload-sim's `dual_stream_block` (norm1, norm1_context, ff, ff_context)."""
    d, ff = cfg.d, cfg.ff
    b = Block()
    for m in ("norm1.linear", "norm1_context.linear"):
        b.linear(m, 6 * d, d)
    for p in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"):
        b.linear(f"attn.{p}", d, d)
    for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        b.rms(f"attn.{n}", cfg.head_dim)
    for f in ("ff", "ff_context"):
        b.linear(f"{f}.net.0.proj", ff, d)
        b.linear(f"{f}.net.2", d, ff)
    return b


def single_stream_block(cfg: Config) -> "Block":
    d, ff = cfg.d, cfg.ff
    b = Block()
    b.linear("norm.linear", 3 * d, d)
    b.linear("proj_mlp", ff, d)
    b.linear("proj_out", d, d + ff)
    for p in ("to_q", "to_k", "to_v"):
        b.linear(f"attn.{p}", d, d)
    b.rms("attn.norm_q", cfg.head_dim)
    b.rms("attn.norm_k", cfg.head_dim)
    return b


class Block(Unit):
    """One DiT block's forward, as the bench's: its kernels, attention, the chain step."""

    def forward(self, proxy: "Proxy", tokens: int) -> None:
        self.own_kernels(proxy, tokens)
        proxy.attention(tokens)
        proxy.chain()


class DiT(Unit):
    """offload-sim's `flux_transformer`: root tensors, 19 double + 38 single blocks (full size)."""

    def __init__(self, cfg: Config):
        super().__init__()
        d = cfg.d
        self.linear("x_embedder", d, cfg.in_ch)
        self.linear("context_embedder", d, cfg.ctx)
        for e in ("timestep_embedder", "guidance_embedder"):
            self.linear(f"time_text_embed.{e}.linear_1", d, cfg.time)
            self.linear(f"time_text_embed.{e}.linear_2", d, d)
        self.linear("time_text_embed.text_embedder.linear_1", d, cfg.pooled)
        self.linear("time_text_embed.text_embedder.linear_2", d, d)
        self.add_module("pos_embed", Node())
        self.pos_embed.register_buffer("freqs", torch.empty(*cfg.freqs, dtype=torch.float32), persistent=False)
        self.transformer_blocks = nn.ModuleList(dual_stream_block(cfg) for _ in range(cfg.double))
        self.single_transformer_blocks = nn.ModuleList(
            single_stream_block(cfg) for _ in range(cfg.single))
        self.linear("norm_out.linear", 2 * d, d)
        self.linear("proj_out", cfg.in_ch, d)

    def blocks(self):
        return list(self.transformer_blocks) + list(self.single_transformer_blocks)

    def forward(self, proxy: "Proxy", tokens: int) -> None:
        # The bench's `step`: the root's own tensors (norm_out and proj_out among them) first, a
        # chain step, then every block in order.
        self.own_kernels(proxy, tokens, extra=[self.pos_embed.freqs])
        proxy.chain()
        for blk in self.blocks():
            blk(proxy, tokens)


def describe(model: DiT, cfg: Config):
    """Bytes and GEMMs of the model (works on the meta device)."""
    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts)

    blocks = model.blocks()
    block_ids = {id(p) for b in blocks for p in b.parameters()}
    root_tensors = [p for p in model.parameters() if id(p) not in block_ids] + list(model.buffers())
    gemm_elems = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    block_bytes = [nbytes(b.parameters()) for b in blocks]
    return dict(
        parameters=sum(p.numel() for p in model.parameters()),
        weight_bytes=nbytes(model.parameters()) + nbytes(model.buffers()),
        root_bytes=nbytes(root_tensors),
        streamed_bytes=sum(block_bytes),
        largest_block_bytes=max(block_bytes),
        double_block_bytes=block_bytes[0],
        single_block_bytes=block_bytes[cfg.double] if cfg.single else 0,
        blocks=len(blocks),
        gemm_weight_elements=gemm_elems,
        widest_in=max(p.shape[1] for p in model.parameters() if p.dim() == 2),
        widest_out=max(p.shape[0] for p in model.parameters() if p.dim() == 2),
    )


def flops_per_step(info, cfg: Config, tokens: int) -> int:
    """One forward: 2·tokens·in·out per weight GEMM, 2 × 2·heads·tokens²·head_dim per block."""
    return 2 * tokens * info["gemm_weight_elements"] + info["blocks"] * 4 * cfg.heads * tokens * tokens * cfg.head_dim


def scratch_elements(info, cfg: Config, tokens: int):
    """The bench's `scratch_bytes` / 2: activations and outputs for the widest GEMM and attention."""
    qkv, scores = tokens * cfg.head_dim, tokens * tokens
    inp = max(tokens * info["widest_in"], cfg.heads * qkv)
    out = max(tokens * info["widest_out"], cfg.heads * (scores + qkv))
    return inp, out


# ----------------------------------------------------------------------------------------------
# Deterministic weights: a function of (tensor name, global element index) only, so every world
# size, every rank's shard and the resident model hold the same full tensors.
# ----------------------------------------------------------------------------------------------


def _fnv(name: str) -> int:
    h = 0xCBF29CE484222325
    for b in name.encode():
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def _pattern(name: str, dtype: torch.dtype) -> torch.Tensor:
    """TILE values uniform in +-0.1, seeded by the tensor's name (so all blocks differ)."""
    g = torch.Generator().manual_seed(_fnv(name) & 0x7FFFFFFFFFFFFFFF)
    return torch.rand(TILE, generator=g).mul_(0.2).sub_(0.1).to(dtype)


def fill(t: torch.Tensor, name: str, start: int) -> None:
    """Writes element i of the flat tensor `t` as pattern[(start + i) mod TILE]."""
    flat = t.view(-1)
    pat = _pattern(name, t.dtype)
    off = start % TILE
    rolled = torch.cat([pat[off:], pat[:off]]).to(t.device)  # rolled[j] = pattern[(start + j) mod TILE]
    n = flat.numel()
    whole = n // TILE
    if whole:
        flat[: whole * TILE].view(whole, TILE).copy_(rolled.expand(whole, TILE))
    flat[whole * TILE:].copy_(rolled[: n - whole * TILE])


def init_weights(model: nn.Module) -> None:
    """Every parameter (its local shard, where sharded) and buffer, deterministically."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            local, start = p, 0
            if hasattr(p, "to_local"):  # a DTensor sharded on dim 0 (FSDP2's Shard(0))
                local = p.to_local()
                ws, rank = p.device_mesh.size(), p.device_mesh.get_local_rank()
                rows = p.shape[0]
                chunk = -(-rows // ws)
                first = min(rank * chunk, rows)
                expect = max(0, min(chunk, rows - first))
                if local.shape[0] != expect or tuple(local.shape[1:]) != tuple(p.shape[1:]):
                    raise RuntimeError(f"{name}: local shard {tuple(local.shape)} is not rows "
                                       f"{first}..{first + expect} of {tuple(p.shape)}")
                start = first * (p.numel() // max(rows, 1))
            if local.numel():
                fill(local, name, start)
        for name, b in model.named_buffers():
            fill(b, name, 0)


def buffers_to(model: nn.Module, device) -> None:
    """FSDP2 shards parameters only: buffers go to the compute device by hand."""
    for m in model.modules():
        for k, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[k] = b.to(device)


# ----------------------------------------------------------------------------------------------
# The compute proxy (offload-cuda's Proxy, in torch ops on one stream).
# ----------------------------------------------------------------------------------------------


class Proxy:
    """Scratch activations and outputs for the largest token count, allocated once.

    * linear: Y[t, out] = X[t, in] . W^T into the output scratch (bf16, f32 accumulation);
    * attention: S = Q K^T, O = S V over heads x tokens x head_dim, Q = K = V = the activations (as
      the bench: no softmax);
    * fold: a unit's tensors read whole and summed exactly (bf16 as int16, f32 as int32, into int64,
      per row of each 2-D tensor; rows weighted by their position in the unit, so a swapped or
      shifted shard changes it; int64 wraps, still exactly) into `sum`;
    * chain: state = (state * M + sum) mod P, sum = 0, the first activations rewritten from the state,
      so later GEMMs depend on every weight before. `state` (exact, from the weights' bytes in block
      order) must be equal on every rank and to the resident run's. GEMM outputs are not folded (the
      bench folds their first rows): the folds already read the very tensors the GEMMs read."""

    def __init__(self, info, cfg: Config, max_tokens: int, device):
        self.cfg = cfg
        inp, out = scratch_elements(info, cfg, max_tokens)
        self.x = torch.full((inp,), 0.01147, dtype=torch.bfloat16, device=device)  # 0x3c3c, as the bench
        self.y = torch.empty(out, dtype=torch.bfloat16, device=device)
        self.sum = torch.zeros((), dtype=torch.int64, device=device)
        self.state = torch.zeros((), dtype=torch.int64, device=device)
        n = min(CHAIN_ELEMENTS, inp)
        self.ramp = torch.arange(n, dtype=torch.int64, device=device) * 7919
        self.positions = {}
        self.scratch_bytes = (inp + out) * 2

    def reset(self):
        self.x.fill_(0.01147)
        self.sum.zero_()
        self.state.zero_()

    def linear(self, w: torch.Tensor, tokens: int) -> None:
        out_f, in_f = w.shape
        y = self.y[: tokens * out_f].view(tokens, out_f)
        torch.mm(self.x[: tokens * in_f].view(tokens, in_f), w.t(), out=y)

    def attention(self, tokens: int) -> None:
        h, d = self.cfg.heads, self.cfg.head_dim
        q = self.x[: h * tokens * d].view(h, tokens, d)
        s = self.y[: h * tokens * tokens].view(h, tokens, tokens)
        o = self.y[h * tokens * tokens: h * tokens * (tokens + d)].view(h, tokens, d)
        torch.bmm(q, q.transpose(1, 2), out=s)
        torch.bmm(s, q, out=o)

    @staticmethod
    def _ints(t: torch.Tensor) -> torch.Tensor:
        return t.detach().view({torch.bfloat16: torch.int16, torch.float32: torch.int32}[t.dtype])

    def fold(self, two_d, one_d) -> None:
        parts = [self._ints(t).sum(dim=1, dtype=torch.int64) for t in two_d]
        if one_d:
            parts.append(torch.cat([self._ints(t).reshape(-1) for t in one_d]).to(torch.int64))
        if not parts:
            return
        v = torch.cat(parts)
        pos = self.positions.get(v.numel())
        if pos is None:
            pos = self.positions[v.numel()] = torch.arange(1, v.numel() + 1, dtype=torch.int64, device=v.device)
        self.sum.add_(v.mul_(pos).sum())

    def chain(self) -> None:
        self.state.mul_(STATE_MUL).add_(self.sum).remainder_(STATE_MOD)
        self.sum.zero_()
        n = self.ramp.numel()
        v = torch.remainder(self.state + self.ramp, 251).to(torch.float32).mul_(2.0 ** -12).add_(2.0 ** -7)
        self.x[:n].copy_(v)

    def output(self) -> int:
        return int(self.state.item())


# ----------------------------------------------------------------------------------------------
# Distributed set-up, timing, reporting.
# ----------------------------------------------------------------------------------------------


def fail(msg: str, code: int = 2):
    print(f"fsdp2_cpu_offload: {msg}", file=sys.stderr, flush=True)
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - already failing; the message above is what matters
            pass
    sys.exit(code)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", nargs="+", default=["4608", "16896"],
                    help="token counts (image + text) per forward, space- or comma-separated")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per token count (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up steps per token count")
    ap.add_argument("--json", default=None, help="write the results as JSON here (rank 0)")
    ap.add_argument("--no-resident", action="store_true",
                    help="skip the resident run (the compute floor; needs the whole model on each GPU)")
    ap.add_argument("--tiny", action="store_true", help="a tiny DiT of the same structure (smoke test)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: gloo and host compute, for smoke tests only (no pinning, no CUDA timing)")
    ap.add_argument("--describe", action="store_true",
                    help="print the model's bytes, GEMMs and FLOPs (and shard bytes per rank) on the "
                         "meta device, then exit")
    args = ap.parse_args(argv)
    try:
        tokens = [int(s) for t in args.tokens for s in t.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--tokens: {' '.join(args.tokens)!r} is not a list of numbers (e.g. 4608 16896)")
    if not tokens:
        ap.error("--tokens names no token count")
    for t in tokens:
        if not 1 <= t <= MAX_TOKENS:
            ap.error(f"--tokens: {t} is outside 1..={MAX_TOKENS}")
    if not 1 <= args.steps <= MAX_STEPS:
        ap.error(f"--steps: {args.steps} is outside 1..={MAX_STEPS}")
    if not 0 <= args.warmup <= MAX_WARMUP:
        ap.error(f"--warmup: {args.warmup} is outside 0..={MAX_WARMUP}")
    args.tokens = tokens
    return args


def init_distributed(device_type: str):
    """Ranks from the launcher's environment (torchrun, offload-launch); one rank when started bare."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    except (KeyError, ValueError) as e:
        fail(f"RANK, WORLD_SIZE and LOCAL_RANK must be integers ({e})")
    for k in ("MASTER_ADDR", "MASTER_PORT"):
        if k not in os.environ:
            fail(f"{k} is not set: launch with torchrun or offload-launch (they set RANK, WORLD_SIZE, "
                 "LOCAL_RANK, MASTER_ADDR, MASTER_PORT)")
    if not dist.is_available():
        fail("this torch build has no torch.distributed")
    if device_type == "cuda":
        if not torch.cuda.is_available():
            fail(f"no CUDA device is visible to torch {torch.__version__} "
                 f"(CUDA build: {torch.version.cuda}); the benchmark needs {world} GPU(s). "
                 "For a CPU smoke test use --tiny --device cpu")
        if local_rank >= torch.cuda.device_count():
            fail(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPU(s) are visible")
        if not dist.is_nccl_available():
            fail(f"torch {torch.__version__} was built without NCCL; FSDP2 on GPUs needs it")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        try:
            dist.init_process_group("nccl", device_id=device)
        except TypeError:  # torch < 2.3: no device_id
            dist.init_process_group("nccl")
        except Exception as e:  # noqa: BLE001 - report, do not trace back
            fail(f"initialising NCCL failed: {e}")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    mesh = init_device_mesh(device_type, (world,))
    return rank, world, local_rank, device, mesh


def barrier(device):
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def agree(ok: bool, device) -> bool:
    """True only if every rank says so (so that all ranks take the same path)."""
    t = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_bandwidth(device) -> float:
    """Pinned host->device GB/s, 1 GiB copies, median of five after one, all ranks at once."""
    if device.type != "cuda":
        return 0.0
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    times = []
    for _ in range(6):
        sync(device)
        barrier(device)  # every rank copies at once, as FSDP2's per-block copies do
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - t)
    del host, dev
    torch.cuda.empty_cache()
    return n / statistics.median(times[1:]) / 1e9


def time_steps(model, proxy, tokens, warmup, steps, device):
    """Per step: synchronize, barrier, CUDA events around one forward, synchronize. Returns the
    timed steps' seconds (events; host clock on CPU), host-clock seconds, and the output."""
    ev, wall = [], []
    proxy.reset()
    with torch.no_grad():
        for i in range(warmup + steps):
            sync(device)
            barrier(device)
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t = time.perf_counter()
            model(proxy, tokens)
            if device.type == "cuda":
                end.record()
            sync(device)
            w = time.perf_counter() - t
            if i >= warmup:
                wall.append(w)
                ev.append(start.elapsed_time(end) / 1e3 if device.type == "cuda" else w)
    return ev, wall, proxy.output()


def spread(v):
    return dict(median=statistics.median(v), min=min(v), max=max(v))


def gather(values, device):
    """Every rank's list of numbers (same length on all), as float64: all_gather_object needs numpy."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def run_setting(name, model, proxy, tokens, args, device, rank, world, baseline, enable_s, host):
    """One row: timing and memory on every rank, gathered to all."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ev, wall, state = time_steps(model, proxy, tokens, args.warmup, args.steps, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0
    n = args.steps
    ranks = []
    for r, v in enumerate(gather(ev + wall + [peak, reserved, state, host["host_param_bytes"],
                                               host["host_storage_bytes"], host["host_params_pinned"],
                                               host["host_pinned_allocator_bytes"]], device)):
        steps_s, wall_s = v[:n], v[n:2 * n]
        peak_r, reserved_r, state_r, hp, hs, pin, pa = v[2 * n:]
        ranks.append(dict(rank=r, steps_s=steps_s, wall_steps_s=wall_s, step_s=spread(steps_s),
                          wall_step_s=spread(wall_s), peak_device_bytes=int(peak_r),
                          peak_above_scratch_bytes=max(0, int(peak_r) - baseline),
                          peak_reserved_bytes=int(reserved_r), output_state=int(state_r),
                          host_param_bytes=int(hp), host_storage_bytes=int(hs), host_params_pinned=bool(pin),
                          host_pinned_allocator_bytes=int(pa)))
    # The group's step is its slowest rank's: per step, the max over ranks.
    worst = [max(r["steps_s"][i] for r in ranks) for i in range(n)]
    row = dict(run=name, tokens=tokens, world_size=world, step_s=statistics.median(worst),
               step_spread_s=[min(worst), max(worst)], steps_max_over_ranks_s=worst,
               peak_device_bytes=max(r["peak_device_bytes"] for r in ranks),
               peak_device_gb=max(r["peak_device_bytes"] for r in ranks) / 1e9,
               peak_above_scratch_bytes=max(r["peak_above_scratch_bytes"] for r in ranks),
               host_param_bytes_per_rank=max(r["host_param_bytes"] for r in ranks),
               host_pinned_allocator_bytes_per_rank=max(r["host_pinned_allocator_bytes"] for r in ranks),
               enable_s=enable_s, output=ranks[0]["output_state"], output_state=ranks[0]["output_state"],
               outputs_equal_across_ranks=len({r["output_state"] for r in ranks}) == 1,
               per_rank=ranks)
    if rank == 0:
        print(f"{name} at {tokens} tokens: {row['step_s']:.3f} s/step (max over ranks; "
              f"{row['step_spread_s'][0]:.3f}-{row['step_spread_s'][1]:.3f}), "
              f"peak {row['peak_device_bytes'] / 1e9:.2f} GB, state {row['output_state']}", file=sys.stderr, flush=True)
    return row


def host_bytes(model) -> dict:
    """Local shard bytes on the host (as the parameters' local tensors), the storages behind them
    (FSDP2 pads each shard to ceil(rows / G) rows) and whether all are pinned."""
    local, storages, pinned, on_host = 0, {}, True, True
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        local += t.numel() * t.element_size()
        on_host &= t.device.type == "cpu"
        if t.numel():
            pinned &= t.is_pinned()
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return dict(host_param_bytes=local if on_host else 0, host_storage_bytes=sum(storages.values()) if on_host else 0,
                host_params_pinned=pinned and on_host)


def host_pinned(device) -> int:
    """Bytes the CUDA pinned-host allocator holds (it rounds each block up to a power of two)."""
    if device.type != "cuda":
        return 0
    try:
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    except Exception:  # noqa: BLE001 - older torch: no host allocator statistics
        return 0


def nccl_version():
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a report field, not worth failing over
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def build(cfg: Config) -> DiT:
    with torch.device("meta"):
        return DiT(cfg)


def shard(model: DiT, mesh, device):
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for blk in model.blocks():
        fully_shard(blk, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)


def print_description(info, cfg, tokens, out=sys.stdout):
    print(f"DiT ({'tiny' if cfg.tiny else 'Flux.1-dev size'}): {info['blocks']} blocks "
          f"({cfg.double} double + {cfg.single} single), hidden {cfg.d}, {info['parameters']:,} parameters, "
          f"{info['weight_bytes']:,} weight bytes (parameters bf16 + the f32 freqs buffer); "
          f"streamed (blocks) {info['streamed_bytes']:,}, root {info['root_bytes']:,}, "
          f"largest block {info['largest_block_bytes']:,} (double {info['double_block_bytes']:,}, "
          f"single {info['single_block_bytes']:,})", file=out)
    if not cfg.tiny:
        same = (info["weight_bytes"], info["streamed_bytes"], info["largest_block_bytes"]) == (
            BENCH_WEIGHT_BYTES, BENCH_STREAMED_BYTES, BENCH_LARGEST_BLOCK_BYTES)
        print(f"offload-bench's flux1_dev_dit: {BENCH_WEIGHT_BYTES:,} / {BENCH_STREAMED_BYTES:,} / "
              f"{BENCH_LARGEST_BLOCK_BYTES:,} bytes: {'equal' if same else 'DIFFERENT'}", file=out)
    for t in tokens:
        inp, o = scratch_elements(info, cfg, t)
        print(f"  {t} tokens: {flops_per_step(info, cfg, t) / 1e12:.2f} TFLOP per step "
              f"({2 * t * info['gemm_weight_elements'] / 1e12:.2f} in weight GEMMs), "
              f"scratch {(inp + o) * 2 / 1e9:.2f} GB", file=out)


def main(argv=None):
    args = parse_args(argv)
    cfg = Config(args.tiny)
    info = describe(build(cfg), cfg)

    if args.describe:
        if "RANK" not in os.environ:
            print_description(info, cfg, args.tokens)
            return 0
        # Launched with ranks: shard on the meta device (no memory) and report each rank's shard.
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh("cpu", (world,))
        model = build(cfg)
        shard(model, mesh, torch.device("cpu"))
        local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        per_rank = [int(v[0]) for v in gather([local], torch.device("cpu"))]
        if rank == 0:
            print_description(info, cfg, args.tokens)
            print(f"  shard bytes per rank (G = {world}): {per_rank} (sum {sum(per_rank):,})")
        dist.destroy_process_group()
        return 0

    rank, world, _, device, mesh = init_distributed(args.device)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if rank == 0 else (lambda *a: None)
    if rank == 0:
        print_description(info, cfg, args.tokens, out=sys.stderr)
    max_t = max(args.tokens)
    inp, out = scratch_elements(info, cfg, max_t)
    scratch = (inp + out) * 2
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        need = scratch + info["root_bytes"] + 3 * info["largest_block_bytes"] + HEADROOM_BYTES
        if not agree(need <= free, device):
            fail(f"--tokens {max_t} needs {scratch / 1e9:.1f} GB of proxy scratch beside the gathered blocks "
                 f"and {free / 1e9:.1f} GB is free on rank {rank}'s GPU; give smaller token counts")
        resident_fits = agree(scratch + info["weight_bytes"] + HEADROOM_BYTES <= free, device)
    else:
        resident_fits = True
    bw = pinned_bandwidth(device)
    bws = [v[0] for v in gather([bw], device)]
    proxy = Proxy(info, cfg, max_t, device)
    # Warm cuBLAS (its workspace comes from the caching allocator) before the baseline, so the
    # baseline is the proxy's scratch and workspace, as the bench's `used_before`.
    with torch.no_grad():
        w = torch.zeros(8, 8, dtype=torch.bfloat16, device=device)
        proxy.linear(w, 8)
        proxy.attention(1)
        proxy.reset()
    sync(device)
    torch_alloc = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0

    rows = []
    if args.no_resident or not resident_fits:
        if not args.no_resident:
            say("resident run skipped: the whole model and the scratch do not fit on the GPU")
    else:
        t = time.perf_counter()
        resident = build(cfg).to_empty(device=device)
        init_weights(resident)
        sync(device)
        enable_s = time.perf_counter() - t
        for tokens in args.tokens:
            rows.append(run_setting("resident", resident, proxy, tokens, args, device, rank, world,
                                    torch_alloc, enable_s, dict(host_param_bytes=0, host_storage_bytes=0,
                                                                host_params_pinned=False,
                                                                host_pinned_allocator_bytes=0)))
        del resident
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    barrier(device)
    pinned_before = host_pinned(device)
    t = time.perf_counter()
    model = build(cfg)
    shard(model, mesh, device)
    model.to_empty(device="cpu")  # host shards (FSDP2 pins them on to_empty's reset)
    init_weights(model)
    buffers_to(model, device)
    sync(device)
    enable_s = time.perf_counter() - t
    host = host_bytes(model)
    host["host_pinned_allocator_bytes"] = host_pinned(device) - pinned_before
    enables = [v[0] for v in gather([enable_s], device)]
    say(f"FSDP2 set-up (meta build, fully_shard, to_empty on the host, pin, init): "
        f"{max(enables):.1f} s; host params {host['host_param_bytes'] / 1e9:.2f} GB on rank 0, "
        f"pinned: {host['host_params_pinned']} (the pinned allocator grew by "
        f"{host['host_pinned_allocator_bytes'] / 1e9:.2f} GB)")
    if device.type == "cuda" and not host["host_params_pinned"]:
        say("warning: the host shards are not all pinned")
    for tokens in args.tokens:
        rows.append(run_setting("fsdp2 cpu offload", model, proxy, tokens, args, device, rank, world,
                                torch_alloc, max(enables), host))

    # The limit, as the bench's: max(resident step, streamed bytes / (G x per-rank bandwidth)).
    transfer = info["streamed_bytes"] / (world * min(bws) * 1e9) if min(bws) > 0 else 0.0
    floor = {r["tokens"]: (r["step_s"], r["output_state"]) for r in rows if r["run"] == "resident"}
    for r in rows:
        res = floor.get(r["tokens"])
        r["limit_s"] = (max(res[0], transfer if r["run"] != "resident" else 0.0) if res else None)
        r["ratio"] = r["step_s"] / r["limit_s"] if r["limit_s"] else None
        r["output_equals_resident"] = (r["output_state"] == res[1]) if res else None
        r["flops_per_step_per_rank"] = flops_per_step(info, cfg, r["tokens"])

    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        nccl = nccl_version() if device.type == "cuda" else None
        print(f"\nFSDP2 peer: {info['parameters'] / 1e9:.2f} B parameters, {info['weight_bytes'] / 1e9:.2f} GB; "
              f"G = {world} x {name}; torch {torch.__version__}, NCCL {nccl}; pinned host->device "
              f"{', '.join(f'{b:.1f}' for b in bws)} GB/s per rank (all at once); "
              f"transfer floor {transfer:.3f} s")
        print("| run | tokens | s / step (max over ranks) | spread | per rank | limit s | step / limit "
              "| peak device GB | above scratch GB | host params GB / rank | pinned GB / rank | enable s "
              "| state = resident | same on all ranks |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        for r in rows:
            per = " / ".join(f"{p['step_s']['median']:.3f}" for p in r["per_rank"])
            print(f"| {r['run']} | {r['tokens']} | {r['step_s']:.3f} | {r['step_spread_s'][0]:.3f}-"
                  f"{r['step_spread_s'][1]:.3f} | {per} | {fmt(r['limit_s'], '.3f')} | {fmt(r['ratio'], '.3f')} | "
                  f"{r['peak_device_bytes'] / 1e9:.2f} | {r['peak_above_scratch_bytes'] / 1e9:.2f} | "
                  f"{r['host_param_bytes_per_rank'] / 1e9:.2f} | "
                  f"{r['host_pinned_allocator_bytes_per_rank'] / 1e9:.2f} | {r['enable_s']:.1f} | "
                  f"{fmt(r['output_equals_resident'], '')} | {r['outputs_equal_across_ranks']} |")
        if args.json:
            doc = dict(peer="fsdp2_cpu_offload", torch=torch.__version__, nccl=nccl, device=name,
                       world_size=world, tiny=cfg.tiny, parameters=info["parameters"],
                       weight_bytes=info["weight_bytes"], streamed_bytes=info["streamed_bytes"],
                       largest_block_bytes=info["largest_block_bytes"], pinned_h2d_gbps=bws,
                       transfer_floor_s=transfer, scratch_bytes=scratch, baseline_device_bytes=torch_alloc,
                       nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"), rows=rows)
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
    bad = [r for r in rows if not r["outputs_equal_across_ranks"] or r["output_equals_resident"] is False]
    barrier(device)
    dist.destroy_process_group()
    if bad:
        if rank == 0:
            print(f"{len(bad)} rows: ranks disagree or differ from resident (the gathered weights are wrong)",
                  file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
