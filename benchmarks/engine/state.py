"""The state the engine benchmark saves: a GPT-style transformer's fp32 weights plus Adam state
built from noise (no training), and the simulated compute between saves."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch

from benchmarks._lib.timing import perf

PAGE = 4096
ALIGN = 64
CHUNK = 64 * 1024 * 1024


def transformer_layout(
    target_bytes: int,
) -> tuple[list[tuple[str, tuple[int, ...]]], dict[str, int]]:
    """Parameter names and shapes of a GPT-style transformer whose weights + Adam state (12
    bytes per parameter) come to about ``target_bytes``."""
    if target_bytes < 300e6:
        d, vocab = 384, 8192
    elif target_bytes < 2e9:
        d, vocab = 1024, 32768
    else:
        d, vocab = 2048, 32768
    per_layer = 12 * d * d + 13 * d
    target_params = target_bytes / 12
    layers = max(1, round((target_params - vocab * d - 2 * d) / per_layer))
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("tok_emb.weight", (vocab, d)),
        ("pos_emb.weight", (1024, d)),
    ]
    for i in range(layers):
        p = f"blocks.{i}."
        shapes += [
            (p + "ln1.weight", (d,)),
            (p + "ln1.bias", (d,)),
            (p + "attn.qkv.weight", (3 * d, d)),
            (p + "attn.qkv.bias", (3 * d,)),
            (p + "attn.proj.weight", (d, d)),
            (p + "attn.proj.bias", (d,)),
            (p + "ln2.weight", (d,)),
            (p + "ln2.bias", (d,)),
            (p + "mlp.fc1.weight", (4 * d, d)),
            (p + "mlp.fc1.bias", (4 * d,)),
            (p + "mlp.fc2.weight", (d, 4 * d)),
            (p + "mlp.fc2.bias", (d,)),
        ]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return shapes, {"d_model": d, "vocab": vocab, "layers": layers}


def build_state(target_bytes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    shapes, info = transformer_layout(target_bytes)
    gen = torch.Generator().manual_seed(0)
    source = torch.randn(16 * 2**20 + 4099, generator=gen)  # 64 MB of noise, copied around

    def filled(shape: tuple[int, ...], salt: int) -> torch.Tensor:
        t = torch.empty(shape)
        flat = t.view(-1)
        pos, start = 0, (salt * 7919) % 4096
        while pos < flat.numel():
            n = min(flat.numel() - pos, source.numel() - start)
            flat[pos : pos + n].copy_(source[start : start + n])
            pos += n
            start = 0
        return t

    model = collections.OrderedDict()
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    for i, (name, shape) in enumerate(shapes):
        model[name] = filled(shape, 3 * i)
        opt_state[i] = {
            "step": torch.tensor(float(100)),
            "exp_avg": filled(shape, 3 * i + 1),
            "exp_avg_sq": filled(shape, 3 * i + 2).abs_(),
        }
    param_groups = [
        {
            "lr": 3e-4,
            "betas": (0.9, 0.999),
            "eps": 1e-8,
            "weight_decay": 0.0,
            "amsgrad": False,
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "params": list(range(len(shapes))),
        }
    ]
    state = {
        "model": model,
        "optim": {"state": opt_state, "param_groups": param_groups},
        "step": 100,
    }
    tensors = list(model.values()) + [t for s in opt_state.values() for t in s.values()]
    info.update(
        params=sum(t.numel() for t in model.values()),
        tensors=len(tensors),
        bytes=sum(t.numel() * t.element_size() for t in tensors),
    )
    return state, info


def flat_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The state's tensors under dotted names (what safetensors can hold)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state["model"].items():
        out[f"model.{k}"] = v
    for i, s in state["optim"]["state"].items():
        for k, v in s.items():
            out[f"optim.state.{i}.{k}"] = v
    return out


def clone_tree(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return type(x)((k, clone_tree(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return type(x)(clone_tree(v) for v in x)
    return x


class BenchArena:
    """The reused, page-aligned buffer of the copy limit and the raw disk writes."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        offsets, off = [], 0
        for t in tensors:
            offsets.append(off)
            off = (off + t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN
        self.total = max((off + PAGE - 1) // PAGE * PAGE, PAGE)
        raw = torch.empty(self.total + PAGE, dtype=torch.uint8)
        start = (-raw.data_ptr()) % PAGE
        self.bytes = raw[start : start + self.total]
        self._raw = raw
        self.views = [
            self.bytes[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for o, t in zip(offsets, tensors, strict=True)
        ]
        self.np = self.bytes.numpy()


def compute_fn(seconds: float) -> tuple[Callable[[], None], dict[str, Any]]:
    """Matmuls that take about ``seconds`` on an idle machine (the simulated forward/backward)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    for _ in range(3):
        a @ b
    trials = []
    for _ in range(20):  # the fastest trial: robust against other processes on the cores
        t0 = perf()
        for _ in range(3):
            a @ b
        trials.append((perf() - t0) / 3)
    one = min(trials)
    n = max(1, round(seconds / one))

    def compute() -> None:
        for _ in range(n):
            torch.mm(a, b)

    return compute, {"matmul_1024_s": one, "matmuls": n, "target_s": seconds}
