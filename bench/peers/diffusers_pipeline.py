#!/usr/bin/env python3
"""The whole-request peer: diffusers' recipe for Flux.1-dev on a card smaller than the model.

One request = what FluxPipeline does for one 1024x1024 image, batch 1, without tokenizers:
  encode   CLIP-L `CLIPTextModel` (77 seeded random token ids -> pooler_output, 768) and
           T5-XXL `T5EncoderModel` (512 seeded random token ids -> last_hidden_state, 512 x 4096), once;
  denoise  --steps (28) forwards of `FluxTransformer2DModel` (Flux.1-dev config, guidance embeds) on
           --tokens (4608) = 512 text + 4096 image tokens (a 64x64 packed grid of 1x64 latents), each
           followed by a flow-matching Euler update of the latents with Flux's shifted sigmas (so each
           step depends on the one before);
  decode   unpack to (1, 16, 128, 128), z / 0.3611 + 0.1159, `AutoencoderKL.decode` (Flux's VAE config)
           to (1, 3, 1024, 1024), then the pipeline's post-processing to uint8 on the host.
Every component has random weights that look trained (per tensor normal_(0, 1/sqrt(fan_in)) for
>=2-D weights, 1 + normal_(0, 0.02) for 1-D weights (norm scales), normal_(0, 0.02) for biases),
built on the meta device, materialised in bf16 on the host.

Runs (each a set of requests over the same components):
  group offload  diffusers.hooks.apply_group_offloading(..., onload_device=cuda, offload_device=cpu,
                 offload_type="block_level", num_blocks_per_group=1, use_stream=True) on every
                 component. Plain block_level only streams a module's direct ModuleList children,
                 so it is pointed at each one's blocks: the transformer as is (transformer_blocks.*,
                 single_transformer_blocks.*); T5 on its T5Stack t5.encoder, which holds all its
                 weights (block.*; embed_tokens is the tied `shared`); CLIP with
                 block_modules=["encoder"] (encoder.layers.*); the VAE with its own
                 _group_offload_block_modules (decoder.up_blocks.* ...; what vae.enable_group_offload()
                 passes too). --plain-block-level applies it to each whole component with no
                 block_modules, exactly as pipe.enable_group_offload() does: then each text encoder is
                 ONE synchronous group (all of it copied in at its forward and out after, no stream).
                 A component on which block_level raises falls back to offload_type="leaf_level",
                 use_stream=True. The recipe each component got is recorded with its groups
                 (streamed / synchronous, GB).
  resident       (--resident) every component .to("cuda"): the compute floor.
  --device cpu   the CPU smoke test: streams need CUDA, so the offload run applies the same
                 recipe with onload = offload = cpu and use_stream=False (it checks the hooks and
                 that the output equals the resident run's), plus a resident run on the CPU.

Measured per run: time per image = one whole request (encode + denoise + decode + the copy of the
image to the host), torch.cuda.synchronize() before each clock read, median of --requests timed
requests after --warmup warm-up requests (the first group-offloaded request also records the
execution order that the stream prefetching follows); then one separate instrumented request with a
synchronize between phases and after every step, for the encode / denoise / decode times, the
per-step times and each phase's peak memory (the timed requests are not slowed by it). Peak device
memory = torch.cuda.max_memory_allocated() / max_memory_reserved() over the warm-up and timed
requests. Set-up = the apply_group_offloading calls (they pin a host copy of every weight) or the
.to("cuda") calls, synchronised. Prints a markdown table last; --json writes the same fields plus
the versions, the GPU and the per-component details.

Usage:
  python3 bench/peers/diffusers_pipeline.py [--steps 28] [--tokens 4608 | --height 1024 --width 1024]
      [--requests 2] [--warmup 1] [--resident] [--no-offload] [--plain-block-level]
      [--record-stream] [--no-inference-mode] [--json FILE] [--device cuda|cpu] [--tiny]
  python3 bench/peers/diffusers_pipeline.py --tiny --device cpu --steps 3 --json /tmp/peer.json
"""

import argparse
import gc
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

TEXT_TOKENS = 512          # T5 sequence length of FluxPipeline (max_sequence_length=512)
CLIP_TOKENS = 77
CLIP_VOCAB = 49408
CLIP_BOS, CLIP_EOS = 49406, 49407
CLIP_PROMPT_TOKENS = 20    # BOS + 18 random ids + EOS, padded with EOS (CLIP's pad token)
T5_VOCAB = 32128
T5_EOS = 1
T5_PROMPT_TOKENS = 24      # random ids + EOS, padded with 0 (T5's pad token); no attention mask, as Flux
LATENT_CHANNELS = 16
PIXELS_PER_CELL = 16       # one packed 2x2 latent cell = 16 x 16 pixels (VAE scale factor 8)
VAE_SCALING, VAE_SHIFT = 0.3611, 0.1159
GUIDANCE = 3.5
SEED = 0
GB = 1e9

COMPONENTS = ("transformer", "t5", "clip", "vae")
SHORT = {"transformer": "DiT", "t5": "T5", "clip": "CLIP", "vae": "VAE"}
# Where block_level is applied so that it reaches each text encoder's ModuleList of layers:
# (submodule, block_modules). T5: its T5Stack `encoder` holds every weight (embed_tokens is the tied
# `shared`) and has the ModuleList `block`; block_modules=["encoder"] on T5EncoderModel would leave
# `shared` in a second synchronous group whose prefetch tracer collides with the stack's.
# CLIP: CLIPTextModel -> encoder -> layers (transformers 5; 4.x had text_model -> encoder -> layers),
# reached by block_modules, its embeddings and final_layer_norm in the one synchronous group.
ENCODER_TARGETS = {"t5": ("encoder", None), "clip": ("", ["encoder"])}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="diffusers group-offloading peer on a whole Flux.1-dev request "
                    "(text encoders + denoising steps + VAE decode), random weights.")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (default 28; 3 with --tiny)")
    ap.add_argument("--tokens", type=int, default=None,
                    help="transformer tokens = 512 text + image tokens, the image tokens a square grid "
                         "(default 4608 = 512 + 64x64; 576 = 512 + 8x8 with --tiny)")
    ap.add_argument("--height", type=int, default=None,
                    help="image height in pixels, a multiple of 16 (default: from --tokens)")
    ap.add_argument("--width", type=int, default=None,
                    help="image width in pixels, a multiple of 16 (default: from --tokens)")
    ap.add_argument("--requests", type=int, default=2, help="timed requests per run (median)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up requests per run, not timed")
    ap.add_argument("--resident", action="store_true", help="also run every component resident on the GPU")
    ap.add_argument("--no-offload", action="store_true", help="skip the group-offload run (implies --resident)")
    ap.add_argument("--plain-block-level", action="store_true",
                    help="block_level without block_modules on the text encoders, as pipe.enable_group_offload() "
                         "does (each encoder becomes one synchronous group)")
    ap.add_argument("--record-stream", action="store_true",
                    help="pass record_stream=True to apply_group_offloading (default False, its default)")
    ap.add_argument("--no-inference-mode", action="store_true",
                    help="run under torch.no_grad() (as FluxPipeline.__call__) instead of torch.inference_mode()")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true",
                    help="tiny models (2+2 DiT blocks of width 64, 2-layer encoders, small VAE) for a CPU check")
    ap.add_argument("--seed", type=int, default=SEED, help="seed of the weights, token ids and noise")
    args = ap.parse_args(argv)

    if args.steps is None:
        args.steps = 3 if args.tiny else 28
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.requests < 1:
        ap.error(f"--requests must be >= 1, got {args.requests}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")

    if (args.height is None) != (args.width is None):
        ap.error("give both --height and --width, or neither")
    if args.height is not None:
        for flag, v in (("--height", args.height), ("--width", args.width)):
            if v <= 0 or v % PIXELS_PER_CELL:
                ap.error(f"{flag} must be a positive multiple of {PIXELS_PER_CELL} (one packed latent cell), got {v}")
        grid_h, grid_w = args.height // PIXELS_PER_CELL, args.width // PIXELS_PER_CELL
        tokens = TEXT_TOKENS + grid_h * grid_w
        if args.tokens is not None and args.tokens != tokens:
            ap.error(f"--tokens {args.tokens} disagrees with --height {args.height} --width {args.width} "
                     f"({TEXT_TOKENS} text + {grid_h}x{grid_w} image tokens = {tokens})")
        args.tokens = tokens
    else:
        if args.tokens is None:
            args.tokens = TEXT_TOKENS + (64 if args.tiny else 4096)
        image = args.tokens - TEXT_TOKENS
        side = math.isqrt(image) if image > 0 else 0
        if image <= 0 or side * side != image:
            ap.error(f"--tokens {args.tokens}: the image tokens (tokens - {TEXT_TOKENS} = {image}) must be a "
                     f"positive square grid, e.g. 4608 = 512 + 64x64, 16896 = 512 + 128x128")
        grid_h = grid_w = side
        args.height, args.width = grid_h * PIXELS_PER_CELL, grid_w * PIXELS_PER_CELL
    args.grid_h, args.grid_w = grid_h, grid_w
    args.image_tokens = grid_h * grid_w

    if args.no_offload:
        args.resident = True
    if args.device == "cpu":
        args.resident = True  # the CPU check always has the resident run to compare against
    return args, ap


def die(msg, code=2):
    print(f"diffusers_pipeline: {msg}", file=sys.stderr)
    sys.exit(code)


try:
    import torch
except ImportError as e:  # pragma: no cover - depends on the machine
    die(f"PyTorch is not importable ({e})")
try:
    import diffusers
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from diffusers.hooks import apply_group_offloading
except ImportError as e:  # pragma: no cover
    die(f"diffusers is not importable ({e}); install the wheels in .whl/ "
        "(pip install --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site)")
try:
    import transformers
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel
except ImportError as e:  # pragma: no cover
    die(f"transformers is not importable ({e})")


# ---------------------------------------------------------------------------------------------- models

def configs(tiny):
    """The four components' configurations: Flux.1-dev's (black-forest-labs/FLUX.1-dev model_index
    components), or tiny ones of the same structure."""
    if tiny:
        flux = dict(patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=2, num_single_layers=2,
                    attention_head_dim=32, num_attention_heads=2, joint_attention_dim=64,
                    pooled_projection_dim=64, guidance_embeds=True, axes_dims_rope=(8, 12, 12))
        t5 = dict(vocab_size=T5_VOCAB, d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2)
        clip = dict(vocab_size=CLIP_VOCAB, hidden_size=64, intermediate_size=128, projection_dim=64,
                    num_hidden_layers=2, num_attention_heads=2)
        vae = dict(block_out_channels=[32, 32, 64, 64], layers_per_block=1, sample_size=128)
    else:
        flux = dict(patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=19, num_single_layers=38,
                    attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                    pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
        # google/t5-v1_1-xxl (FLUX.1-dev text_encoder_2)
        t5 = dict(vocab_size=T5_VOCAB, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64)
        # openai/clip-vit-large-patch14 text tower (FLUX.1-dev text_encoder)
        clip = dict(vocab_size=CLIP_VOCAB, hidden_size=768, intermediate_size=3072, projection_dim=768,
                    num_hidden_layers=12, num_attention_heads=12)
        vae = dict(block_out_channels=[128, 256, 512, 512], layers_per_block=2, sample_size=1024)
    t5.update(relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.1,
              layer_norm_epsilon=1e-6, feed_forward_proj="gated-gelu",
              is_encoder_decoder=False, use_cache=False)
    # legacy eos_token_id=2 as in the CLIP-L config: pooling takes the argmax id, the EOS (49407)
    clip.update(max_position_embeddings=CLIP_TOKENS, hidden_act="quick_gelu", layer_norm_eps=1e-5,
                bos_token_id=0, eos_token_id=2, pad_token_id=1)
    vae.update(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
               up_block_types=["UpDecoderBlock2D"] * 4, act_fn="silu", latent_channels=LATENT_CHANNELS,
               norm_num_groups=32, scaling_factor=VAE_SCALING, shift_factor=VAE_SHIFT, force_upcast=True,
               use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True)
    return dict(transformer=flux, t5=t5, clip=clip, vae=vae)


def empty_weights():
    """Parameters on the meta device, buffers (CLIP's position_ids, ...) real: accelerate's
    init_empty_weights(include_buffers=False), or an equivalent if accelerate is missing."""
    try:
        from accelerate import init_empty_weights
        return init_empty_weights(include_buffers=False)
    except ImportError:
        pass
    import contextlib

    @contextlib.contextmanager
    def ctx():
        old = torch.nn.Module.register_parameter

        def register(module, name, param):
            old(module, name, param)
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        torch.nn.Module.register_parameter = register
        try:
            yield
        finally:
            torch.nn.Module.register_parameter = old
    return ctx()


def fill(name, t, seed):
    """Random values that look trained, one generator per tensor (threads can fill in parallel)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        if t.dim() >= 2:
            fan_in = math.prod(t.shape[1:])
            t.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=g)
        elif name.endswith("bias"):
            t.normal_(0.0, 0.02, generator=g)
        else:  # 1-D weights: norm scales (LayerNorm, RMSNorm, GroupNorm, T5LayerNorm)
            t.normal_(1.0, 0.02, generator=g)
    return t.numel()


def materialise(model, seed, workers):
    """Meta parameters -> bf16 host tensors (tied ones stay tied), filled in parallel."""
    memo, jobs = {}, []
    for mname, mod in model.named_modules():
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in memo:
                if p.is_meta:
                    data = torch.empty(p.shape, dtype=torch.bfloat16, device="cpu")
                    new = torch.nn.Parameter(data, requires_grad=False)
                    jobs.append((f"{mname}.{pname}" if mname else pname, data))
                else:
                    new = torch.nn.Parameter(p.data.to(torch.bfloat16), requires_grad=False)
                    jobs.append((f"{mname}.{pname}" if mname else pname, new.data))
                memo[id(p)] = new
            mod._parameters[pname] = memo[id(p)]
    for mod in model.modules():  # floating buffers to bf16, as from_pretrained(torch_dtype=torch.bfloat16)
        for bname, b in list(mod._buffers.items()):
            if b is None:
                continue
            if b.is_meta:
                raise RuntimeError(f"buffer {bname} of {type(mod).__name__} is still on the meta device")
            if b.is_floating_point() and b.dtype != torch.bfloat16:
                mod._buffers[bname] = b.to(torch.bfloat16)
    jobs.sort(key=lambda j: -j[1].numel())
    with ThreadPoolExecutor(max_workers=workers) as ex:
        list(ex.map(lambda ij: fill(ij[1][0], ij[1][1], seed * 1_000_003 + ij[0]), enumerate(jobs)))
    return model.eval()


def build(name, cfg, seed, workers):
    with empty_weights():
        if name == "transformer":
            m = FluxTransformer2DModel(**cfg)
        elif name == "t5":
            m = T5EncoderModel(T5Config(**cfg))
        elif name == "clip":
            m = CLIPTextModel(CLIPTextConfig(**cfg))
        elif name == "vae":
            m = AutoencoderKL(**cfg)
        else:
            raise ValueError(name)
    if isinstance(m, transformers.PreTrainedModel):
        m.tie_weights()  # post_init does not tie on the meta device: T5's encoder.embed_tokens is `shared`
    return materialise(m, seed, workers)


def nbytes(module):
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


# ---------------------------------------------------------------------------------------------- recipe

def remove_group_offloading(module):
    """Best effort: drop the hooks a failed apply_group_offloading may have left."""
    try:
        from diffusers.hooks.hooks import HookRegistry
        from diffusers.hooks import group_offloading as go
        reg = HookRegistry.check_if_exists_or_initialize(module)
        for key in ("_GROUP_OFFLOADING", "_LAYER_EXECUTION_TRACKER", "_LAZY_PREFETCH_GROUP_OFFLOADING"):
            if hasattr(go, key):
                reg.remove_hook(getattr(go, key), recurse=True)
    except Exception:
        pass


def describe_groups(module):
    """The ModuleGroups that apply_group_offloading made: how many, bytes streamed / synchronous."""
    try:
        from diffusers.hooks import group_offloading as go
        key = go._GROUP_OFFLOADING
    except Exception:
        return {}
    groups = {}
    for sub in module.modules():
        reg = getattr(sub, "_diffusers_hook", None)
        hook = reg.get_hook(key) if reg is not None else None
        if hook is not None:
            groups[id(hook.group)] = hook.group
    streamed = dict(n=0, bytes=0)
    sync = dict(n=0, bytes=0)
    largest = 0
    for g in groups.values():
        seen, b = set(), 0
        tensors = [t for m in g.modules for t in list(m.parameters()) + list(m.buffers())]
        for t in tensors + list(g.parameters) + list(g.buffers):
            if id(t) not in seen:
                seen.add(id(t))
                b += t.numel() * t.element_size()
        d = streamed if g.stream is not None else sync
        d["n"] += 1
        d["bytes"] += b
        largest = max(largest, b)
    return dict(groups=len(groups), streamed_groups=streamed["n"], streamed_gb=streamed["bytes"] / GB,
                sync_groups=sync["n"], sync_gb=sync["bytes"] / GB, largest_group_gb=largest / GB)


def apply_recipe(name, module, onload, use_stream, record_stream, plain):
    """block_level, one block per group, streams; leaf_level with streams where block_level fails."""
    common = dict(onload_device=onload, offload_device=torch.device("cpu"), use_stream=use_stream,
                  record_stream=record_stream and use_stream)
    sub, block_modules = (("", None) if plain else ENCODER_TARGETS.get(name, ("", None)))
    if block_modules is not None and name == "clip" and hasattr(module, "text_model"):
        block_modules = ["text_model"] + block_modules  # transformers 4.x layout
    target = module.get_submodule(sub) if sub else module
    where = f"{name}.{sub} ({type(target).__name__})" if sub else f"{name} ({type(module).__name__})"
    stream_txt = "use_stream=True" if use_stream else "use_stream=False (cpu check)"
    if common["record_stream"]:
        stream_txt += ", record_stream=True"
    try:
        kw = dict(common, offload_type="block_level", num_blocks_per_group=1)
        if block_modules is not None:
            kw["block_modules"] = block_modules
        apply_group_offloading(target, **kw)
        eff = block_modules if block_modules is not None else getattr(target, "_group_offload_block_modules", None)
        if eff:  # those that exist (Flux's VAE has no quant_conv / post_quant_conv)
            eff = [n for n in eff if getattr(target, n, None) is not None]
        recipe = f"apply_group_offloading({where}, block_level, num_blocks_per_group=1, {stream_txt}"
        if eff:
            recipe += f", block_modules={eff}" + ("" if block_modules is not None else " (the model's own)")
        recipe += ")"
        short = "block" + (f"@{sub}" if sub else "") + (f"[{','.join(eff)}]" if eff else "")
        short += "/stream" if use_stream else "/no-stream"
        fallback = None
    except Exception as e:
        fallback = f"{type(e).__name__}: {e}"
        print(f"  {name}: block_level failed ({fallback}); falling back to leaf_level", flush=True)
        remove_group_offloading(module)
        apply_group_offloading(module, **dict(common, offload_type="leaf_level"))
        recipe = (f"apply_group_offloading({name} ({type(module).__name__}), leaf_level, {stream_txt}) "
                  f"(block_level failed: {fallback})")
        short = "leaf" + ("/stream" if use_stream else "/no-stream")
    return dict(recipe=recipe, short=short, block_level_error=fallback, **describe_groups(module))


# ---------------------------------------------------------------------------------------------- request

def flux_sigmas(steps, image_tokens):
    """FluxPipeline + FlowMatchEulerDiscreteScheduler (use_dynamic_shifting, base/max shift 0.5/1.15 over
    256..4096 image tokens): linspace(1, 1/steps, steps), shifted by mu, then the terminal 0."""
    m = (1.15 - 0.5) / (4096 - 256)
    mu = image_tokens * m + (0.5 - m * 256)
    sig = [1.0 - i * (1.0 - 1.0 / steps) / (steps - 1) for i in range(steps)] if steps > 1 else [1.0]
    sig = [math.exp(mu) / (math.exp(mu) + (1.0 / s - 1.0)) for s in sig]
    return sig + [0.0]


def prompt_ids(seed):
    """What the two tokenizers would hand over (seeded random ids, the real special tokens and padding)."""
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    clip = torch.full((1, CLIP_TOKENS), CLIP_EOS, dtype=torch.long)
    clip[0, 0] = CLIP_BOS
    clip[0, 1:CLIP_PROMPT_TOKENS - 1] = torch.randint(0, CLIP_BOS, (CLIP_PROMPT_TOKENS - 2,), generator=g)
    t5 = torch.zeros((1, TEXT_TOKENS), dtype=torch.long)
    t5[0, :T5_PROMPT_TOKENS - 1] = torch.randint(2, T5_VOCAB, (T5_PROMPT_TOKENS - 1,), generator=g)
    t5[0, T5_PROMPT_TOKENS - 1] = T5_EOS
    return clip, t5


class Clock:
    """Phase marks; with instrument=True a synchronize at each mark and each step, plus per-phase peaks."""

    def __init__(self, dev, instrument):
        self.cuda = dev.type == "cuda"
        self.instrument = instrument
        self.phases, self.steps, self.peaks = {}, [], {}
        self.sync()
        self.t0 = self.last = self.step_t = time.perf_counter()
        self.reset_peak()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self):
        if self.instrument and self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def mark(self, phase):
        if not self.instrument:
            return
        self.sync()
        now = time.perf_counter()
        self.phases[phase] = now - self.last
        if self.cuda:
            self.peaks[phase] = dict(allocated_gb=torch.cuda.max_memory_allocated() / GB,
                                     reserved_gb=torch.cuda.max_memory_reserved() / GB)
        self.reset_peak()
        self.last = self.step_t = now

    def step(self):
        if not self.instrument:
            return
        self.sync()
        now = time.perf_counter()
        self.steps.append(now - self.step_t)
        self.step_t = now

    def total(self):
        self.sync()
        return time.perf_counter() - self.t0


def request(c, spec, dev, instrument=False):
    """One image, as FluxPipeline.__call__ (guidance_scale 3.5, batch 1, output uint8 on the host)."""
    bf16 = torch.bfloat16
    clock = Clock(dev, instrument)
    # encode_prompt: CLIP pooled output, T5 last hidden state
    pooled = c["clip"](input_ids=spec["clip_ids"].to(dev), output_hidden_states=False).pooler_output
    prompt = c["t5"](input_ids=spec["t5_ids"].to(dev), output_hidden_states=False).last_hidden_state
    pooled, prompt = pooled.to(bf16), prompt.to(bf16)
    clock.mark("encode")

    # prepare_latents: noise (1, 16, 2gh, 2gw) from a CPU generator, packed to (1, gh*gw, 64)
    gh, gw = spec["grid_h"], spec["grid_w"]
    gen = torch.Generator(device="cpu").manual_seed(spec["seed"] + 2)
    noise = torch.randn((1, LATENT_CHANNELS, 2 * gh, 2 * gw), generator=gen).to(dev, bf16)
    latents = noise.view(1, LATENT_CHANNELS, gh, 2, gw, 2).permute(0, 2, 4, 1, 3, 5)
    latents = latents.reshape(1, gh * gw, LATENT_CHANNELS * 4)
    img_ids = torch.zeros(gh, gw, 3, device=dev)
    img_ids[..., 1] += torch.arange(gh, device=dev)[:, None]
    img_ids[..., 2] += torch.arange(gw, device=dev)[None, :]
    img_ids = img_ids.reshape(gh * gw, 3).to(bf16)
    txt_ids = torch.zeros(TEXT_TOKENS, 3, device=dev, dtype=bf16)
    guidance = torch.full((1,), GUIDANCE, device=dev, dtype=torch.float32)
    sig = spec["sigmas"]
    for i in range(spec["steps"]):
        timestep = torch.full((1,), sig[i], device=dev, dtype=bf16)  # = t / 1000, as the pipeline passes it
        v = c["transformer"](hidden_states=latents, timestep=timestep, guidance=guidance,
                             pooled_projections=pooled, encoder_hidden_states=prompt,
                             txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        # FlowMatchEulerDiscreteScheduler.step: in float32, back to the model dtype
        latents = (latents.float() + (sig[i + 1] - sig[i]) * v.float()).to(bf16)
        clock.step()
    clock.mark("denoise")

    # _unpack_latents, scaling / shift, vae.decode, image_processor.postprocess
    z = latents.view(1, gh, gw, LATENT_CHANNELS, 2, 2).permute(0, 3, 1, 4, 2, 5)
    z = z.reshape(1, LATENT_CHANNELS, 2 * gh, 2 * gw)
    z = z / VAE_SCALING + VAE_SHIFT
    image = c["vae"].decode(z, return_dict=False)[0]
    image = (image.float() / 2 + 0.5).clamp(0, 1).mul(255).round().to(torch.uint8).cpu()
    clock.mark("decode")
    total = clock.total()
    if instrument:  # after the clock: a check, not part of the request
        clock.latents_finite = bool(torch.isfinite(latents).all())
        clock.latents_std = float(latents.float().std())
    return total, image, clock


# ---------------------------------------------------------------------------------------------- runs

def host_peak_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB  # ru_maxrss is KiB on Linux


def run_requests(label, c, spec, dev, grad_ctx, setup_s, setup_per, recipes):
    cuda = dev.type == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, image = [], None
    with grad_ctx():
        for i in range(spec["warmup"] + spec["requests"]):
            t, image, _ = request(c, spec, dev)
            kind = "warm-up" if i < spec["warmup"] else "timed"
            if i >= spec["warmup"]:
                times.append(t)
            print(f"  {label}: request {i + 1} ({kind}) {t:.3f} s", flush=True)
        peak_alloc = torch.cuda.max_memory_allocated() / GB if cuda else None
        peak_res = torch.cuda.max_memory_reserved() / GB if cuda else None
        t_inst, image_inst, clock = request(c, spec, dev, instrument=True)
    print(f"  {label}: instrumented request {t_inst:.3f} s "
          f"(encode {clock.phases['encode']:.3f}, denoise {clock.phases['denoise']:.3f}, "
          f"decode {clock.phases['decode']:.3f})", flush=True)
    return dict(
        run=label,
        time_per_image_s=statistics.median(times),
        request_times_s=times,
        encode_s=clock.phases["encode"],
        denoise_s=clock.phases["denoise"],
        step_s=clock.phases["denoise"] / spec["steps"],
        step_median_s=statistics.median(clock.steps),
        step_times_s=clock.steps,
        decode_s=clock.phases["decode"],
        instrumented_request_s=t_inst,
        peak_allocated_gb=peak_alloc,
        peak_reserved_gb=peak_res,
        phase_peaks=clock.peaks or None,
        setup_s=setup_s,
        setup_per_component_s=setup_per,
        recipe={k: v["recipe"] for k, v in recipes.items()},
        recipe_short={k: v["short"] for k, v in recipes.items()},
        groups={k: {kk: vv for kk, vv in v.items() if kk not in ("recipe", "short")} for k, v in recipes.items()},
        host_peak_rss_gb=host_peak_gb(),
        image_mean=float(image.float().mean()),
        image_std=float(image.float().std()),
        latents_finite=clock.latents_finite,
        latents_std=clock.latents_std,
        instrumented_equals_timed=bool(torch.equal(image, image_inst)),
        _image=image,
    )


def main():
    global args
    args, _ = parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        die("--device cuda, but torch.cuda.is_available() is False; use --device cpu (the CPU check)")
    if args.warmup == 0 and not args.no_offload:
        print("note: --warmup 0: the first group-offloaded request also records the prefetch order "
              "(blocking copies), so it is slower than the rest", flush=True)
    grad_ctx = torch.no_grad if args.no_inference_mode else torch.inference_mode
    workers = max(1, min(32, os.cpu_count() or 1))
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else None
    print(f"diffusers pipeline peer: {'tiny' if args.tiny else 'Flux.1-dev'} components, {args.steps} steps, "
          f"{args.tokens} tokens ({TEXT_TOKENS} text + {args.grid_h}x{args.grid_w} image), "
          f"{args.height}x{args.width} image, device {args.device}{' (' + gpu + ')' if gpu else ''}; "
          f"torch {torch.__version__}, diffusers {diffusers.__version__}, transformers {transformers.__version__}",
          flush=True)

    cfgs = configs(args.tiny)
    comps, info = {}, {}
    for i, name in enumerate(COMPONENTS):
        t = time.perf_counter()
        comps[name] = build(name, cfgs[name], args.seed * 16 + i, workers)
        dt = time.perf_counter() - t
        m = comps[name]
        info[name] = dict(cls=type(m).__name__, parameters=sum(p.numel() for p in m.parameters()),
                          bytes=nbytes(m), build_s=dt)
        print(f"  built {name} ({type(m).__name__}): {info[name]['parameters'] / 1e9:.3f} B parameters, "
              f"{info[name]['bytes'] / GB:.2f} GB bf16, {dt:.1f} s", flush=True)

    clip_ids, t5_ids = prompt_ids(args.seed)
    spec = dict(clip_ids=clip_ids, t5_ids=t5_ids, grid_h=args.grid_h, grid_w=args.grid_w, steps=args.steps,
                sigmas=flux_sigmas(args.steps, args.image_tokens), seed=args.seed,
                warmup=args.warmup, requests=args.requests)
    rows = []
    try:
        import accelerate
        acc = accelerate.__version__
    except ImportError:
        acc = None

    def dump(complete):
        """--json after every run (a run cut short by a time limit still leaves the ones before)."""
        if not args.json:
            return
        out = dict(
            complete=complete,
            config=dict(steps=args.steps, tokens=args.tokens, text_tokens=TEXT_TOKENS,
                        image_tokens=args.image_tokens, grid=[args.grid_h, args.grid_w],
                        latent=[LATENT_CHANNELS, 2 * args.grid_h, 2 * args.grid_w],
                        height=args.height, width=args.width, requests=args.requests, warmup=args.warmup,
                        tiny=args.tiny, device=args.device, seed=args.seed, guidance=GUIDANCE,
                        plain_block_level=args.plain_block_level, record_stream=args.record_stream,
                        grad_mode="no_grad" if args.no_inference_mode else "inference_mode",
                        sigmas=spec["sigmas"]),
            components={n: dict(info[n], config=cfgs[n]) for n in COMPONENTS},
            total_bytes=sum(info[n]["bytes"] for n in COMPONENTS),
            versions=dict(python=platform.python_version(), torch=torch.__version__,
                          torch_cuda=torch.version.cuda, diffusers=diffusers.__version__,
                          transformers=transformers.__version__, accelerate=acc),
            gpu=gpu,
            host=dict(cpus=os.cpu_count(), machine=platform.machine(), peak_rss_gb=host_peak_gb()),
            rows=[{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
        )
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)

    if args.resident:
        label = "resident" if dev.type == "cuda" else "resident (cpu)"
        per = {}
        t_all = time.perf_counter()
        for name in COMPONENTS:
            t = time.perf_counter()
            comps[name].to(dev)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            per[name] = time.perf_counter() - t
        setup = time.perf_counter() - t_all
        recipes = {n: dict(recipe=f'.to("{dev.type}")', short="resident") for n in COMPONENTS}
        rows.append(run_requests(label, comps, spec, dev, grad_ctx, setup, per, recipes))
        dump(complete=False)
        if not args.no_offload and dev.type == "cuda":
            for name in COMPONENTS:
                comps[name].to("cpu")
            gc.collect()
            torch.cuda.empty_cache()

    if not args.no_offload:
        use_stream = dev.type == "cuda"
        label = "group offload" if use_stream else "group offload (cpu, no stream)"
        per, recipes = {}, {}
        t_all = time.perf_counter()
        for name in COMPONENTS:
            t = time.perf_counter()
            recipes[name] = apply_recipe(name, comps[name], dev, use_stream, args.record_stream,
                                         args.plain_block_level)
            if use_stream:
                torch.cuda.synchronize()
            per[name] = time.perf_counter() - t
            g = recipes[name]
            print(f"  {name}: {g['recipe']}; {g.get('streamed_groups', '?')} streamed groups "
                  f"({g.get('streamed_gb', 0):.2f} GB), {g.get('sync_groups', '?')} synchronous "
                  f"({g.get('sync_gb', 0):.2f} GB); set-up {per[name]:.1f} s", flush=True)
        setup = time.perf_counter() - t_all
        rows.append(run_requests(label, comps, spec, dev, grad_ctx, setup, per, recipes))
        dump(complete=False)

    # outputs must agree across runs (same weights, ids, noise): offloading moves bytes, not math
    ref = rows[0]["_image"]
    for r in rows:
        img = r.pop("_image")
        r["max_abs_diff_vs_first_run"] = int((img.int() - ref.int()).abs().max())

    print()
    for r in rows:
        print(f"{r['run']}:")
        for name in COMPONENTS:
            g = r["groups"].get(name, {})
            extra = ""
            if "groups" in g:
                extra = (f" -> {g['streamed_groups']} streamed groups ({g['streamed_gb']:.2f} GB), "
                         f"{g['sync_groups']} synchronous ({g['sync_gb']:.2f} GB), largest {g['largest_group_gb']:.2f} GB")
            print(f"  {name}: {r['recipe'][name]}{extra}")
        if not r["latents_finite"]:
            print("  WARNING: the final latents are not finite")
        if r["max_abs_diff_vs_first_run"]:
            print(f"  WARNING: image differs from the {rows[0]['run']} run's by up to "
                  f"{r['max_abs_diff_vs_first_run']} / 255")
    print()
    fmt = lambda v, p=2: "n/a" if v is None else f"{v:.{p}f}"
    print(f"{'tiny' if args.tiny else 'Flux.1-dev'} request: {args.steps} steps at {args.tokens} tokens, "
          f"{args.height}x{args.width}, {gpu or 'cpu'}; median of {args.requests} after {args.warmup} warm-up")
    print("| run | time per image s | encode s | denoise s (per step s) | decode s | peak allocated GB "
          "| peak reserved GB | set-up s | recipe per component |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        rec = "; ".join(f"{SHORT[n]} {r['recipe_short'][n]}" for n in COMPONENTS)
        print(f"| {r['run']} | {r['time_per_image_s']:.3f} | {r['encode_s']:.3f} | {r['denoise_s']:.3f} "
              f"({r['step_s']:.3f}) | {r['decode_s']:.3f} | {fmt(r['peak_allocated_gb'])} | "
              f"{fmt(r['peak_reserved_gb'])} | {r['setup_s']:.1f} | {rec} |")
    dump(complete=True)


if __name__ == "__main__":
    main()
