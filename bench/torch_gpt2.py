#!/usr/bin/python3
"""The peer of train_bench: the same GPT-2 trained by PyTorch on the CPU.

A plain PyTorch training loop of GPT-2 as Xirang builds it (learned
positions, pre-LayerNorm blocks with biases, tanh-GELU MLP of 4 d_model,
causal attention, the head tied to the token table, vocabulary padded to a
multiple of 128), autograd, AdamW with the foreach implementation, on
random tokens. Prints one JSON line: the median step time after warm-up and
the tokens/s it gives.

    /usr/bin/python3 bench/torch_gpt2.py --n-layer 12 --d-model 768 --n-head 12 --batch 4 --seq 64 --steps 6

Needs Debian's python3-torch (`apt-get install python3-torch`); exits with
status 77 and a message when torch is missing. bench/compare_torch.sh runs
it beside train_bench with the settings that suit it best on a CPU."""
import argparse, json, math, statistics, sys, time

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    print("torch_gpt2: PyTorch is not installed (apt-get install python3-torch)", file=sys.stderr)
    sys.exit(77)


class Block(nn.Module):
    def __init__(self, d, h, seq):
        super().__init__()
        self.h = h
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.register_buffer("mask", torch.full((seq, seq), float("-inf")).triu(1), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // self.h)) + self.mask[:T, :T]
        y = F.softmax(att, dim=-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, layers, d, h, vocab, seq):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, h, seq) for _ in range(layers))
        self.lnf = nn.LayerNorm(d)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        logits = self.lnf(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6, help="timed steps after one warm-up step")
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    a = ap.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    vocab = (a.vocab + 127) // 128 * 128
    model = GPT2(a.n_layer, a.d_model, a.n_head, vocab, a.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)
    gen = torch.Generator().manual_seed(1)
    times = []
    for step in range(a.steps + 1):
        idx = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=gen)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times[1:])
    print(json.dumps({"step_ms": 1e3 * med, "tokens_per_s": a.batch * a.seq / med, "threads": torch.get_num_threads(),
                      "torch": torch.__version__, "loss": float(loss)}))


if __name__ == "__main__":
    main()
