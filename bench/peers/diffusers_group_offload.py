"""The peer: diffusers group offloading (block level, one block per group,
CUDA stream prefetch) on a Flux.1-dev-sized transformer with random bf16
weights, batch 1, at the same token counts as offload-bench, on the same
GPU. Prints a table and writes JSON.

Usage: python3 diffusers_group_offload.py [--tokens 4608,16896] [--steps 5]
       [--warmup 2] [--json peer.json]
"""

import argparse
import json
import statistics
import time

import torch
from diffusers import FluxTransformer2DModel
from diffusers.hooks import apply_group_offloading

TEXT_TOKENS = 512


def random_flux() -> FluxTransformer2DModel:
    """The Flux.1-dev transformer config, weights random (uniform in
    [-0.05, 0.05]: never zeros), bf16, on the host."""
    with torch.device("meta"):
        model = FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,
            num_layers=19,
            num_single_layers=38,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=4096,
            pooled_projection_dim=768,
            guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        )
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.05, 0.05)
        for b in model.buffers():
            b.uniform_(-0.05, 0.05)
    return model.eval()


def inputs(tokens: int):
    image = tokens - TEXT_TOKENS
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(1)
    return dict(
        hidden_states=torch.randn(1, image, 64, generator=g).to(dev, dt),
        encoder_hidden_states=torch.randn(1, TEXT_TOKENS, 4096, generator=g).to(dev, dt),
        pooled_projections=torch.randn(1, 768, generator=g).to(dev, dt),
        timestep=torch.tensor([0.5], device=dev, dtype=dt),
        img_ids=torch.zeros(image, 3, device=dev, dtype=dt),
        txt_ids=torch.zeros(TEXT_TOKENS, 3, device=dev, dtype=dt),
        guidance=torch.tensor([3.5], device=dev, dtype=dt),
        return_dict=False,
    )


def time_steps(model, tokens: int, warmup: int, steps: int):
    x = inputs(tokens)
    times = []
    with torch.no_grad():
        for i in range(warmup + steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model(**x)[0]
            torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t)
    return statistics.median(times), out.float().sum().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4608,16896")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default="peer.json")
    args = ap.parse_args()
    token_counts = [int(t) for t in args.tokens.split(",")]
    model = random_flux()
    params = sum(p.numel() for p in model.parameters())
    rows = []

    model.to("cuda")
    torch.cuda.reset_peak_memory_stats()
    for tokens in token_counts:
        step, out = time_steps(model, tokens, args.warmup, args.steps)
        rows.append(dict(run="diffusers resident", tokens=tokens, step_s=step, output=out,
                         peak_device_gb=torch.cuda.max_memory_allocated() / 1e9, enable_s=0.0))
        print(f"resident {tokens}: {step:.3f} s/step", flush=True)
    model.to("cpu")
    torch.cuda.empty_cache()

    t = time.perf_counter()
    apply_group_offloading(model, onload_device=torch.device("cuda"), offload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=1, use_stream=True)
    torch.cuda.synchronize()
    enable_s = time.perf_counter() - t
    for tokens in token_counts:
        torch.cuda.reset_peak_memory_stats()
        step, out = time_steps(model, tokens, args.warmup, args.steps)
        rows.append(dict(run="diffusers group offload", tokens=tokens, step_s=step, output=out,
                         peak_device_gb=torch.cuda.max_memory_allocated() / 1e9, enable_s=enable_s))
        print(f"group offload {tokens}: {step:.3f} s/step", flush=True)

    print(f"\ndiffusers peer: {params / 1e9:.2f} B parameters; torch {torch.__version__}; "
          f"{torch.cuda.get_device_name()}")
    print("| run | tokens | s / step | peak device GB (allocator) | enable s |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['run']} | {r['tokens']} | {r['step_s']:.3f} | {r['peak_device_gb']:.2f} | {r['enable_s']:.1f} |")
    with open(args.json, "w") as f:
        json.dump(dict(parameters=params, torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
