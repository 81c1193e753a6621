"""Where FP8's quality loss comes from, on the CPU: a plain-torch Llama forward over the real
SmolLM2-135M-Instruct weights with FP8 quantize-dequantize ("fake quant") at chosen places.

Fake quant reproduces the GPU's FP8 numerics up to accumulation order: x ~= fp8(x / s) * s in
float32, then the GEMM in float32 (FP8 products are exact in float32, as in `_scaled_mm`).

    weights      per output channel (today's), per 128-group along K, per 128x128 block
    activations  per token (today's), per token and 128-group along K
    KV cache     fixed scale 1.0 (today's), per layer (amax of the prompt's K/V), per head,
                 per token and head
The compute dtype of everything else is `--dtype` (float32: FP8's own damage; bfloat16: what the
GPU runs). Each row: next-token top-1 agreement with the reference run (`--reference`, same
compute dtype without FP8 unless named), its perplexity on the text against the reference's,
and agreement on the positions where the reference's top-1 beats its top-2 by > `--margin`
(logprob): positions closer than that flip under any noise (see the noise-floor rows).

    python bench/fp8_sensitivity.py --tokens 1024                     # the standard table
    python bench/fp8_sensitivity.py --tokens 512 --rows floor,kv      # some rows
    python bench/fp8_sensitivity.py --tokens 2048 --dtype bfloat16 --rows best [--offset 2048]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.nn import functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmnb.runtime.models.loader import load_tokenizer, resolve_model_dir  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
TEXT = Path(__file__).resolve().parent / "data" / "opticks.txt"
MARGINS = (0.05, 0.1, 0.25, 0.5, 1.0)  # top-1 - top-2 logprob
LINEARS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass(frozen=True)
class Scheme:
    """What is quantized and how. `weights` / `acts`: mode per linear name (missing: 16/32-bit)."""

    name: str
    weights: dict[str, str] = field(default_factory=dict)  # 'channel' | 'group' | 'block'
    acts: dict[str, str] = field(default_factory=dict)  # 'token' | 'group'
    kv: str | None = None  # 'one' | 'layer' | 'head' | 'token_head'
    dtype: torch.dtype | None = None  # compute dtype (None: --dtype)
    skip_layers: tuple[int, ...] = ()  # decoder layers left unquantized
    # Weights rounded by GPTQ (error feedback over a calibration Hessian, columns in activation
    # order) instead of to nearest; only with 'channel' / 'int8' weight modes.
    gptq: bool = False
    # KV with per-(head, channel) means subtracted before the FP8 cast (scale 1): 'prompt' (this
    # prompt's own means) or 'calibrated' (means recorded on other text). Exact for K (a constant
    # shift of every key moves each query's logits by one constant: softmax unchanged); V's
    # mean is added back to the attention output (softmax rows sum to 1).
    kv_smooth: str | None = None
    kv_smooth_scale: str = "one"  # the `quant_kv` mode of the shifted K/V


def fake_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8(x / scale) * scale in float32 (scale broadcasts against x)."""
    scale = scale.clamp_min(1e-12)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale


def quant_weight(w: torch.Tensor, mode: str) -> torch.Tensor:
    """w [N, K] float32 -> fake-quantized w."""
    n, k = w.shape
    if mode == "channel":
        return fake_fp8(w, w.abs().amax(-1, keepdim=True) / FP8_MAX)
    if mode == "int8":  # symmetric int8, one scale per row (not FP8: the comparison)
        s = w.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
        return (w / s).round().clamp(-127, 127) * s
    pad_n, pad_k = (-n) % 128, (-k) % 128  # 576 = 4.5 x 128: zero-padded groups
    wp = F.pad(w, (0, pad_k, 0, pad_n))
    if mode == "group":  # one scale per row and 128 columns
        g = wp.view(n + pad_n, (k + pad_k) // 128, 128)
        s = g.abs().amax(-1, keepdim=True) / FP8_MAX
    elif mode == "block":  # 128 x 128 blocks (DeepSeek-V3's)
        g = wp.view((n + pad_n) // 128, 128, (k + pad_k) // 128, 128)
        s = g.abs().amax(dim=(1, 3), keepdim=True) / FP8_MAX
    else:
        raise ValueError(mode)
    return fake_fp8(g, s).view(n + pad_n, k + pad_k)[:n, :k]


def gptq_weight(w: torch.Tensor, hessian: torch.Tensor, mode: str, *, block: int = 128,
                damp: float = 0.01) -> torch.Tensor:
    """GPTQ (Frantar et al. 2022) onto the FP8 (or int8) grid of per-row scales fixed from w's
    amax: each column's rounding error is fed to the columns not yet rounded, weighted by the
    inverse Hessian of the layer's inputs (hessian [K, K] = sum of x x^T over calibration tokens),
    columns in descending Hessian-diagonal order. w [N, K] float32 -> fake-quantized w."""
    w = w.float().clone()
    amax = w.abs().amax(-1, keepdim=True).clamp_min(1e-12)
    if mode == "channel":
        scale = amax / FP8_MAX

        def rnd(col: torch.Tensor) -> torch.Tensor:
            return fake_fp8(col, scale[:, 0])
    elif mode == "int8":
        scale = amax / 127

        def rnd(col: torch.Tensor) -> torch.Tensor:
            return (col / scale[:, 0]).round().clamp(-127, 127) * scale[:, 0]
    else:
        raise ValueError(f"gptq with weight mode {mode!r}")
    h = hessian.double().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(h.diagonal(), descending=True)
    w, h = w[:, perm], h[perm][:, perm]
    h.diagonal().add_(damp * h.diagonal().mean())
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    hinv = hinv.float()
    q = torch.zeros_like(w)
    k = w.shape[1]
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, h1 = w[:, i1:i2].clone(), hinv[i1:i2, i1:i2]
        err1 = torch.zeros_like(w1)
        for i in range(i2 - i1):
            q[:, i1 + i] = rnd(w1[:, i])
            err = (w1[:, i] - q[:, i1 + i]) / h1[i, i]
            w1[:, i:] -= err[:, None] * h1[i, i:][None, :]
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    out = torch.empty_like(q)
    out[:, perm] = q
    return out


def quant_act(x: torch.Tensor, mode: str) -> torch.Tensor:
    """x [M, K] -> fake-quantized per token (or per token and 128-group)."""
    xf = x.float()
    if mode == "token":
        out = fake_fp8(xf, xf.abs().amax(-1, keepdim=True) / FP8_MAX)
    elif mode == "group":
        m, k = xf.shape
        g = xf.view(m, k // 128, 128) if k % 128 == 0 else xf.view(m, k // 64, 64)
        out = fake_fp8(g, g.abs().amax(-1, keepdim=True) / FP8_MAX).view(m, k)
    else:
        raise ValueError(mode)
    return out.to(x.dtype)


def quant_kv(x: torch.Tensor, mode: str) -> torch.Tensor:
    """x [T, kv_heads, head_dim] -> as the FP8 pool gives it back."""
    xf = x.float()
    if mode == "one":
        s = torch.ones(())
    elif mode == "layer":
        s = xf.abs().amax() / FP8_MAX
    elif mode == "head":
        s = xf.abs().amax(dim=(0, 2), keepdim=True) / FP8_MAX
    elif mode == "token_head":
        s = xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    elif mode == "int8_token_head":  # not FP8: the comparison
        s = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127
        return ((xf / s).round().clamp(-127, 127) * s).to(x.dtype)
    else:
        raise ValueError(mode)
    return fake_fp8(xf, s).to(x.dtype)


def smooth_kv(k: torch.Tensor, v: torch.Tensor, mode: str,
              means: tuple[torch.Tensor, torch.Tensor] | None, kv_mode: str = "one"
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [T, kv_heads, head_dim] as attention sees them from a mean-shifted FP8 pool: K shifted
    (not restored: softmax ignores it), V shifted and restored."""
    if mode == "prompt":
        k_mean, v_mean = k.float().mean(0), v.float().mean(0)
    else:
        assert means is not None, "calibrated means not recorded"
        k_mean, v_mean = means
    k_q = quant_kv(k.float() - k_mean, kv_mode)
    v_q = quant_kv(v.float() - v_mean, kv_mode) + v_mean
    return k_q.to(k.dtype), v_q.to(v.dtype)


class SmolLM:
    def __init__(self, folder: Path) -> None:
        from safetensors.torch import load_file

        self.cfg = json.loads((folder / "config.json").read_text())
        raw = load_file(str(folder / "model.safetensors"))
        self.w = {k.removeprefix("model."): v.float() for k, v in raw.items()}
        c = self.cfg
        self.layers, self.heads, self.kv_heads = (c["num_hidden_layers"], c["num_attention_heads"],
                                                  c["num_key_value_heads"])
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.heads
        theta = (c.get("rope_parameters") or {}).get("rope_theta") or c.get("rope_theta", 1e4)
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        self.eps = c["rms_norm_eps"]
        self._cache: dict[tuple, torch.Tensor] = {}
        self.record: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.kv_means: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        # (layer, linear) -> sum of x x^T of its inputs (float64), while `collect` is on
        self.hessians: dict[tuple[int, str], torch.Tensor] = {}
        self.collect = False

    def weight(self, layer: int, name: str, mode: str | None, dtype: torch.dtype,
               gptq: bool = False) -> torch.Tensor:
        key = (layer, name, mode, dtype, gptq)
        if key not in self._cache:
            full = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                    "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                    "down": "mlp.down_proj"}[name]
            w = self.w[f"layers.{layer}.{full}.weight"]
            if mode is None:
                q = w
            elif gptq:
                q = gptq_weight(w, self.hessians[(layer, name)], mode)
            else:
                q = quant_weight(w, mode)
            self._cache[key] = q.to(dtype)
        return self._cache[key]

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (w * xf).to(x.dtype)

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        freqs = torch.outer(pos.float(), self.inv_freq)
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos()[:, None].to(x.dtype), emb.sin()[:, None].to(x.dtype)
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), -1)
        return x * cos + rot * sin

    @torch.no_grad()
    def logprobs(self, ids: torch.Tensor, s: Scheme, dtype: torch.dtype) -> torch.Tensor:
        """[T, vocab] float32 log-softmax of the next-token logits."""
        t = ids.shape[0]
        pos = torch.arange(t)
        h = self.w["embed_tokens.weight"][ids].to(dtype)

        def lin(x: torch.Tensor, layer: int, name: str) -> torch.Tensor:
            on = layer not in s.skip_layers
            wmode = s.weights.get(name) if on else None
            amode = s.acts.get(name) if on else None
            if self.collect:
                xf = x.double()
                acc = self.hessians.get((layer, name))
                self.hessians[(layer, name)] = xf.t() @ xf + (0 if acc is None else acc)
            if amode is not None:
                x = quant_act(x, amode)
            return x @ self.weight(layer, name, wmode, dtype, s.gptq and wmode is not None).t()

        for i in range(self.layers):
            p = f"layers.{i}."
            x = self.norm(h, self.w[p + "input_layernorm.weight"])
            q = lin(x, i, "q").view(t, self.heads, self.head_dim)
            k = lin(x, i, "k").view(t, self.kv_heads, self.head_dim)
            v = lin(x, i, "v").view(t, self.kv_heads, self.head_dim)
            q, k = self.rope(q, pos), self.rope(k, pos)
            if s.kv is not None and i not in s.skip_layers:
                k, v = quant_kv(k, s.kv), quant_kv(v, s.kv)
            if s.kv_smooth is not None and i not in s.skip_layers:
                k, v = smooth_kv(k, v, s.kv_smooth, self.kv_means.get(i) if self.kv_means else None,
                                 s.kv_smooth_scale)
            if self.record is not None:
                self.record[i] = (k.float().mean(0), v.float().mean(0))
            group = self.heads // self.kv_heads
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                               v.transpose(0, 1), is_causal=True)
            h = h + lin(a.transpose(0, 1).reshape(t, -1), i, "o")
            x = self.norm(h, self.w[p + "post_attention_layernorm.weight"])
            m = F.silu(lin(x, i, "gate")) * lin(x, i, "up")
            h = h + lin(m, i, "down")
        h = self.norm(h, self.w["norm.weight"])
        head = self.w.get("lm_head.weight", self.w["embed_tokens.weight"])
        return torch.log_softmax((h @ head.to(dtype).t()).float(), -1)


def compare(ref: torch.Tensor, lp: torch.Tensor, targets: torch.Tensor,
            margin: float) -> dict[str, float]:
    """ref/lp [T-1, vocab] logprobs at positions predicting targets [T-1]."""
    top2 = ref.topk(2, -1)
    gap = top2.values[:, 0] - top2.values[:, 1]
    # Agreement: the run's top-1 is a token the reference ranks first. 16-bit logits tie at
    # the top at a few % of positions (bf16 against itself: 97% by index); either is the
    # reference's top-1 there.
    agree = ref.gather(1, lp.argmax(-1, keepdim=True))[:, 0] == top2.values[:, 0]
    wide = gap > margin
    ppl = math.exp(-lp.gather(1, targets[:, None]).mean().item())
    ref_ppl = math.exp(-ref.gather(1, targets[:, None]).mean().item())
    kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
    by_margin = {m: agree[gap > m].float().mean().item() for m in MARGINS}
    return {"agree": agree.float().mean().item(), "agree_wide": agree[wide].float().mean().item(),
            "wide_fraction": wide.float().mean().item(), "ppl": ppl,
            "ppl_vs_ref": ppl / ref_ppl - 1, "kl": kl, "agree_by_margin": by_margin,
            "below_margin": {m: (gap <= m).float().mean().item() for m in MARGINS}}


def schemes(rows: set[str]) -> list[Scheme]:
    all_lin = dict.fromkeys(LINEARS, "channel")
    all_tok = dict.fromkeys(LINEARS, "token")
    out: list[Scheme] = []
    if "floor" in rows:
        out += [Scheme("fp32 (no fp8)", dtype=torch.float32),
                Scheme("bf16 (no fp8)", dtype=torch.bfloat16),
                Scheme("fp16 (no fp8)", dtype=torch.float16)]
    if "today" in rows:
        out += [Scheme("W8A8 channel/token (today)", all_lin, all_tok),
                Scheme("KV fp8 scale 1 (today)", kv="one"),
                Scheme("W8A8 + KV (today)", all_lin, all_tok, kv="one")]
    if "split" in rows:
        out += [Scheme("W8 only (W8A16, channel)", all_lin),
                Scheme("A8 only (token)", acts=all_tok)]
        for name in LINEARS:
            out.append(Scheme(f"W8A8 {name} only", {name: "channel"}, {name: "token"}))
    if "finer" in rows:
        out += [Scheme("W8 group128 A8 token", dict.fromkeys(LINEARS, "group"), all_tok),
                Scheme("W8 block128 A8 token", dict.fromkeys(LINEARS, "block"), all_tok),
                Scheme("W8 channel A8 group128", all_lin, dict.fromkeys(LINEARS, "group")),
                Scheme("W8 block128 A8 group128", dict.fromkeys(LINEARS, "block"),
                       dict.fromkeys(LINEARS, "group"))]
    if "w16" in rows:  # weight-only FP8 (W8A16: the skinny GEMV's numerics at batch 1)
        out += [Scheme("W8A16 channel", all_lin),
                Scheme("W8A16 group128", dict.fromkeys(LINEARS, "group")),
                Scheme("W8A16 block128", dict.fromkeys(LINEARS, "block")),
                Scheme("W8A16 channel, layers 0,29 16-bit", all_lin, skip_layers=(0, 29)),
                Scheme("W8A16 channel, down 16-bit", {**all_lin, "down": None})]
    if "gptq" in rows:  # GPTQ rounding onto the same per-channel FP8 grid
        out += [Scheme("W8A16 channel, GPTQ", all_lin, gptq=True),
                Scheme("W8A16 channel, GPTQ, layers 0,29 16-bit", all_lin, gptq=True,
                       skip_layers=(0, 29)),
                Scheme("W8A8 channel/token, GPTQ", all_lin, all_tok, gptq=True)]
    if "kv" in rows:
        out += [Scheme("KV fp8 scale 1 (main)", kv="one")]
        out += [Scheme(f"KV fp8 scale {mode}", kv=mode) for mode in ("layer", "head",
                                                                      "token_head")]
    if "smooth" in rows:
        out += [Scheme("KV fp8, K/V means of the prompt off", kv_smooth="prompt"),
                Scheme("KV fp8, calibrated K/V means off", kv_smooth="calibrated"),
                Scheme("KV fp8 token_head, calibrated means off", kv_smooth="calibrated",
                       kv_smooth_scale="token_head")]
    if "gptq_only" in rows:
        out += [Scheme("W8A16 channel, GPTQ", all_lin, gptq=True),
                Scheme("W8A16 channel, GPTQ, layers 0,29 16-bit", all_lin, gptq=True,
                       skip_layers=(0, 29))]
    if "best" in rows:  # the candidates that meet issue 23's targets, with their baselines
        out += [Scheme("fp32 (no fp8)", dtype=torch.float32),
                Scheme("W8A16 channel", all_lin),
                Scheme("W8A16 channel, GPTQ", all_lin, gptq=True),
                Scheme("W8A16 channel, GPTQ, layers 0,29 16-bit", all_lin, gptq=True,
                       skip_layers=(0, 29)),
                Scheme("KV fp8 scale 1 (main)", kv="one"),
                Scheme("KV fp8 scale token_head", kv="token_head")]
    if "int8" in rows:
        out += [Scheme("W int8 channel (W8A16, not fp8)", dict.fromkeys(LINEARS, "int8")),
                Scheme("KV int8 per token-head (not fp8)", kv="int8_token_head")]
    if "skip" in rows:
        out += [Scheme("W8A8 today, layers 0,29 16-bit", all_lin, all_tok, skip_layers=(0, 29)),
                Scheme("W8A8 today, down 16-bit", {**all_lin, "down": None},
                       {**all_tok, "down": None})]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="HF folder (default: the embedded SmolLM2, converted)")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--offset", type=int, default=0, help="the text's first token measured")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--margin", type=float, default=0.1)
    parser.add_argument("--rows", default="floor,today,split,finer,kv,skip")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--calib-start", type=int, default=4096,
                        help="GPTQ's calibration text: tokens from here (past the GPU run's 4,096)")
    parser.add_argument("--calib-tokens", type=int, default=1024)
    parser.add_argument("--calib-text", type=Path, default=None,
                        help="GPTQ's calibration from this file instead (from its start)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.model is None:
        args.model = resolve_model_dir(None)
    text = TEXT.read_text().split("\n", 2)[2]  # as bench/fp8.py's quality part
    ids = torch.tensor(load_tokenizer(args.model).encode(text)[args.offset:][:args.tokens])
    model = SmolLM(args.model)
    dtype = getattr(torch, args.dtype)
    targets = ids[1:]
    start = time.perf_counter()
    ref = model.logprobs(ids, Scheme("reference"), dtype)[:-1]
    if "smooth" in args.rows:  # means from the text after the measured tokens (calibration)
        model.record = {}
        after = args.offset + args.tokens
        calib = torch.tensor(load_tokenizer(args.model).encode(text)[after:][:512])
        model.logprobs(calib, Scheme("calibration"), dtype)
        model.kv_means, model.record = model.record, None
    rows = schemes(set(args.rows.split(",")))
    if any(r.gptq for r in rows):  # Hessians of every linear's inputs on disjoint text
        if args.calib_text is None:
            all_ids = load_tokenizer(args.model).encode(text)[args.calib_start:]
        else:
            all_ids = load_tokenizer(args.model).encode(args.calib_text.read_text())
        calib = torch.tensor(all_ids[:args.calib_tokens])
        assert (args.calib_text is not None or args.calib_start >= args.offset + args.tokens) \
            and len(calib), "calibration overlaps the text"
        model.collect = True
        model.logprobs(calib, Scheme("calibration"), dtype)
        model.collect = False
    print(f"{args.model.name}, {len(ids)} tokens, reference {args.dtype} "
          f"({time.perf_counter() - start:.1f} s)")
    base = compare(ref, ref, targets, args.margin)
    print(f"reference perplexity {base['ppl']:.3f}; {base['wide_fraction']:.1%} of positions have "
          f"top-1 - top-2 > {args.margin}")
    print("positions with top-1 - top-2 <= m: " + ", ".join(
        f"m={m}: {f:.1%}" for m, f in base["below_margin"].items()))
    results = {"reference": base}
    header = f"{'scheme':40s} {'agree':>7s} {'agree>m':>8s} {'ppl':>8s} {'vs ref':>7s} {'KL':>8s}"
    print(header)
    for s in rows:
        lp = model.logprobs(ids, s, s.dtype or dtype)[:-1]
        r = compare(ref, lp, targets, args.margin)
        results[s.name] = r
        print(f"{s.name:40s} {r['agree']:7.2%} {r['agree_wide']:8.2%} {r['ppl']:8.3f} "
              f"{r['ppl_vs_ref']:+7.2%} {r['kl']:8.5f}  by margin " + " ".join(
                  f"{a:.1%}" for a in r["agree_by_margin"].values()), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
