#!/usr/bin/env python3
"""diffusers' FluxTransformer2DModel as the reference for offload-candle's Flux DiT.

  make-checkpoint --out DIR [--seed S] [--init normal|uniform]
                                           a random-weight Flux.1-dev transformer, bf16,
                                           written with save_pretrained (GPU if present):
                                           normal (default; linear weights N(0, 1/fan_in),
                                           biases N(0, 1/(3 fan_in)), norm weights 1 + N(0, 0.1²):
                                           offload_candle::flux::Init::Normal's law) or uniform
                                           (diffusers' own initialisation: PyTorch's Linear
                                           default, norm weights ones); config.json records it
                                           under `_offload_init` (diffusers ignores `_` keys)
  make-inputs --out F [--side N --rows R --text T]
                                           random inputs: R×N latent tokens (R = N unless given),
                                           T text tokens (seeded)
  forward --ckpt DIR --inputs F --out F    one forward of the checkpoint on the inputs
                                           (a .safetensors of hidden_states, encoder_hidden_states,
                                           pooled_projections, timestep, guidance, img_ids, txt_ids);
                                           writes `output` (bf16)
  bench --ckpt DIR --inputs F --out F      forward as above on the GPU, then: from_pretrained time
                                           (page cache warm), block-level group offload set-up time
                                           and step time, resident step time; one JSON line last
                                           (--resident-only: the resident figures alone)

Inputs and outputs are safetensors so that the Rust side reads the same bytes.
"""
import argparse
import json
import os
import sys
import time

import torch
from safetensors.torch import load_file, save_file


def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def load_inputs(path, dev):
    t = load_file(path, device=dev)
    return dict(
        hidden_states=t["hidden_states"],
        encoder_hidden_states=t["encoder_hidden_states"],
        pooled_projections=t["pooled_projections"],
        timestep=t["timestep"],
        guidance=t["guidance"],
        img_ids=t["img_ids"],
        txt_ids=t["txt_ids"],
        return_dict=False,
    )


def forward(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


INIT_KEY = "_offload_init"


def init_normal(model):
    """Redraws every parameter as offload_candle::flux::Init::Normal does: nn.Linear weights
    N(0, 1/fan_in), biases N(0, 1/(3 fan_in)), norm weights 1 + N(0, 0.1²) and biases N(0, 0.1²).
    Drawn in f32, stored in the parameters' dtype; a parameter of any other module is an error."""
    done = set()
    with torch.no_grad():
        for mod in model.modules():
            params = []
            if isinstance(mod, torch.nn.Linear):
                fan_in = mod.in_features
                params = [(mod.weight, 0.0, fan_in**-0.5), (mod.bias, 0.0, (3 * fan_in) ** -0.5)]
            elif type(mod).__name__.endswith("Norm"):
                params = [(getattr(mod, "weight", None), 1.0, 0.1), (getattr(mod, "bias", None), 0.0, 0.1)]
            for p, mean, std in params:
                if isinstance(p, torch.nn.Parameter):
                    z = torch.randn(p.shape, device=p.device, dtype=torch.float32)
                    p.copy_(z.mul_(std).add_(mean))
                    done.add(id(p))
    missed = [n for n, p in model.named_parameters() if id(p) not in done]
    if missed:
        print(f"init normal: {len(missed)} parameters of no known module keep diffusers' init, e.g. {missed[:4]}",
              file=sys.stderr)
    return missed


def cmd_make_checkpoint(a):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(a.seed)
    t0 = time.perf_counter()
    with torch.device(device()):
        model = FluxTransformer2DModel(guidance_embeds=True).to(torch.bfloat16)
        missed = init_normal(model) if a.init == "normal" else []
    sync()
    t1 = time.perf_counter()
    model.save_pretrained(a.out)
    config = os.path.join(a.out, "config.json")
    with open(config) as f:
        c = json.load(f)
    c[INIT_KEY] = a.init
    with open(config, "w") as f:
        json.dump(c, f, indent=2)
    t2 = time.perf_counter()
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"checkpoint": a.out, "init": a.init, "init_missed": missed, "bytes": n,
                      "init_s": t1 - t0, "save_s": t2 - t1}))


def cmd_make_inputs(a):
    g = torch.Generator().manual_seed(a.seed)
    s = (a.rows or a.side) * a.side
    rand = lambda *shape: (torch.rand(*shape, generator=g) * 2 - 1).to(torch.bfloat16)
    rows = torch.arange(s) // a.side
    cols = torch.arange(s) % a.side
    t = {
        "hidden_states": rand(1, s, 64),
        "encoder_hidden_states": rand(1, a.text, 4096),
        "pooled_projections": rand(1, 768),
        "timestep": torch.tensor([0.5], dtype=torch.float32),
        "guidance": torch.tensor([3.5], dtype=torch.float32),
        "img_ids": torch.stack([torch.zeros(s), rows.float(), cols.float()], dim=1).contiguous(),
        "txt_ids": torch.zeros(a.text, 3),
    }
    save_file(t, a.out)
    print(json.dumps({"inputs": a.out, "tokens": s + a.text}))


def cmd_forward(a):
    from diffusers import FluxTransformer2DModel

    dev = device()
    model = FluxTransformer2DModel.from_pretrained(a.ckpt, torch_dtype=torch.bfloat16).to(dev)
    out = forward(model, load_inputs(a.inputs, dev))
    save_file({"output": out.contiguous().cpu()}, a.out)
    print(json.dumps({"output": a.out, "shape": list(out.shape)}))


def timed_steps(model, inputs, steps):
    forward(model, inputs)  # warm-up
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        forward(model, inputs)
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def cmd_bench(a):
    from diffusers import FluxTransformer2DModel

    inputs = load_inputs(a.inputs, "cuda")
    r = {}
    if not a.resident_only:
        # Set-up from the checkpoint (page cache warm: the caller read it once).
        t0 = time.perf_counter()
        model = FluxTransformer2DModel.from_pretrained(a.ckpt, torch_dtype=torch.bfloat16)
        t1 = time.perf_counter()
        model.enable_group_offload(
            onload_device=torch.device("cuda"),
            offload_device=torch.device("cpu"),
            offload_type="block_level",
            num_blocks_per_group=1,
            use_stream=True,
        )
        sync()
        t2 = time.perf_counter()
        r["from_pretrained_s"] = t1 - t0
        r["group_offload_setup_s"] = t2 - t1
        r["group_offload_step_s"] = timed_steps(model, inputs, a.steps)
        del model
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    model = FluxTransformer2DModel.from_pretrained(a.ckpt, torch_dtype=torch.bfloat16).to("cuda")
    sync()
    r["resident_load_s"] = time.perf_counter() - t0
    out = forward(model, inputs)
    save_file({"output": out.contiguous().cpu()}, a.out)
    r["resident_step_s"] = timed_steps(model, inputs, a.steps)
    r["tokens"] = int(inputs["hidden_states"].shape[1] + inputs["encoder_hidden_states"].shape[1])
    r["diffusers"] = __import__("diffusers").__version__
    r["torch"] = torch.__version__
    with open(os.path.join(a.ckpt, "config.json")) as f:
        r["init"] = json.load(f).get(INIT_KEY, "not recorded")
    print(json.dumps(r))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-checkpoint")
    m.add_argument("--out", required=True)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--init", choices=["normal", "uniform"], default="normal")
    i = sub.add_parser("make-inputs")
    i.add_argument("--out", required=True)
    i.add_argument("--side", type=int, default=64)
    i.add_argument("--rows", type=int, default=None)
    i.add_argument("--text", type=int, default=512)
    i.add_argument("--seed", type=int, default=1)
    f = sub.add_parser("forward")
    b = sub.add_parser("bench")
    for s in (f, b):
        s.add_argument("--ckpt", required=True)
        s.add_argument("--inputs", required=True)
        s.add_argument("--out", required=True)
    b.add_argument("--steps", type=int, default=3)
    b.add_argument("--resident-only", action="store_true")
    a = p.parse_args()
    {
        "make-checkpoint": cmd_make_checkpoint,
        "make-inputs": cmd_make_inputs,
        "forward": cmd_forward,
        "bench": cmd_bench,
    }[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
