#!/usr/bin/env python3
"""The GPU peer of `xirang train`: GPT-2 trained by PyTorch on the same GPU.

nanoGPT's recipe as a demanding user would run it: learned positions,
pre-LayerNorm blocks with biases, tanh-GELU MLP, the head tied to the token
table, vocabulary padded to a multiple of 128, bf16 autocast, causal
scaled_dot_product_attention (its flash backend on Hopper), torch.compile,
fused AdamW, TF32 matmuls allowed. Random tokens (the work per token does not
depend on them). Also measures the bf16 matrix-product rate of the same GPU
(8192^3, random data, the median of timed products after warm-up): the
limit MFU is reported against.

    python3 bench/torch_gpt2_cuda.py --batch 16 --seq 1024 --steps 20 [--no-compile]
    python3 bench/torch_gpt2_cuda.py --attention-only     # causal SDPA alone, B16 T1024 H12 D64 bf16

Prints one JSON line: tokens_per_s (median step), step_ms, model_tflops,
matmul_tflops, mfu_vs_matmul, compile_s. Exit status 77 without torch or a GPU.
"""
import argparse, json, math, statistics, sys, time

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    print("torch_gpt2_cuda: PyTorch is not installed", file=sys.stderr)
    sys.exit(77)


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, layers, d, h, vocab, seq):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(layers))
        self.lnf = nn.LayerNorm(d)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.lnf(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def matmul_tflops(n=8192, reps=20):
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); a @ b; e.record(); e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * n ** 3 / statistics.median(times) / 1e12


def attention_only(a):
    """PyTorch's causal scaled_dot_product_attention (flash backend on Hopper)
    on Xirang's attention_cuda_bench shape: forward and backward medians."""
    B, T, H, D = a.batch, a.seq, a.n_head, a.d_model // a.n_head
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    def timed(f):
        f()
        ms = []
        for _ in range(20):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); f(); e.record(); e.synchronize()
            ms.append(s.elapsed_time(e))
        return statistics.median(ms)
    fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    bwd = timed(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    flops = 2.0 * 2.0 * B * H * T * T * D / 2.0  # causal, as attention_cuda_bench counts
    print(json.dumps({"peer": "pytorch sdpa", "B": B, "T": T, "H": H, "D": D, "fwd_ms": round(fwd, 3),
                      "fwd_tflops": round(flops / fwd / 1e9, 1), "bwd_ms": round(bwd, 3),
                      "bwd_tflops": round(2.5 * flops / bwd / 1e9, 1)}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--attention-only", action="store_true", help="time causal SDPA forward and backward only")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("torch_gpt2_cuda: no CUDA device", file=sys.stderr)
        sys.exit(77)
    if a.attention_only:
        attention_only(a)
        return
    torch.manual_seed(1234)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    peak = matmul_tflops()
    model = GPT2(a.n_layer, a.d_model, a.n_head, a.vocab, a.seq).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    step_fn = model if a.no_compile else torch.compile(model)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randint(0, 50257, (a.batch, a.seq + 1), device="cuda", generator=gen)
    idx, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    t0 = time.time()
    times, losses = [], []
    for i in range(a.steps):
        torch.cuda.synchronize()
        s = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_fn(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - s)
        losses.append(loss.item())
        if i == 0:
            compile_s = time.time() - t0
    warm = times[3:] if len(times) > 5 else times
    step = statistics.median(warm)
    tokens = a.batch * a.seq
    n_params = sum(p.numel() for p in model.parameters())
    # Xirang's count (models/gpt2/gpt2.cc, flops_per_token): 6 x the matrix
    # parameters (12 L C^2 + V C) plus 12 L C T for the attention scores and
    # values, causality not discounted; the same count on both sides.
    L, C, T = a.n_layer, a.d_model, a.seq
    flops_per_token = 6 * (12 * L * C * C + a.vocab * C) + 12 * L * C * T
    model_tflops = flops_per_token * tokens / step / 1e12
    print(json.dumps({
        "peer": "pytorch", "torch": torch.__version__, "compiled": not a.no_compile,
        "batch": a.batch, "seq": a.seq, "steps": a.steps, "step_ms": round(step * 1e3, 3),
        "tokens_per_s": round(tokens / step, 1), "model_tflops": round(model_tflops, 2),
        "matmul_tflops": round(peak, 1), "mfu_vs_matmul": round(model_tflops / peak, 4),
        "compile_s": round(compile_s, 1), "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
        "params": n_params}))


if __name__ == "__main__":
    main()
