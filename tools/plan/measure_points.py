#!/usr/bin/env python3
"""Measures a small set of gpt2_debug trainings on this machine and writes
them as sweep result rows (the format `xirang sweep` writes to results.jsonl),
so that `xirang plan --calibrate` has real data before a sweep exists.

    tools/plan/measure_points.py XIRANG DATA_DIR OUT.jsonl [--passes 3] [--steps 6] [--nice -15]

Points run round-robin, `passes` times each, so that load from other
processes on a shared machine spreads evenly over the points; a point's
numbers are medians over every measured step of every pass (the first
`warmup` steps of each run excluded)."""
import argparse, json, os, statistics, subprocess, sys, tempfile

# (ranks, overrides): model shape, batch and layout of each point. All use
# two ranks, so that every point shares the machine's cores the same way,
# and 256 tokens per microbatch: on a CPU a microbatch's working set decides
# how much of it stays in cache, which the performance model has no term
# for. Each layout appears at even and odd positions (fitted and held out).
POINTS = [
    (2, dict(d_model=128, n_layer=4, seq_len=128, global_batch=8, micro_batch=2, dp=2)),
    (2, dict(d_model=128, n_layer=4, seq_len=128, global_batch=8, micro_batch=2, tp=2)),
    (2, dict(d_model=128, n_layer=4, seq_len=128, global_batch=8, micro_batch=2, pp=2)),
    (2, dict(d_model=192, n_layer=2, seq_len=64, global_batch=16, micro_batch=4, dp=2, zero=1)),
    (2, dict(d_model=192, n_layer=2, seq_len=64, global_batch=8, micro_batch=4, tp=2)),
    (2, dict(d_model=192, n_layer=4, seq_len=64, global_batch=16, micro_batch=4, pp=2)),
    (2, dict(d_model=64, n_layer=8, seq_len=128, global_batch=8, micro_batch=2, dp=2)),
    (2, dict(d_model=64, n_layer=8, seq_len=128, global_batch=4, micro_batch=2, tp=2)),
    (2, dict(d_model=64, n_layer=8, seq_len=128, global_batch=8, micro_batch=2, pp=2)),
    (2, dict(d_model=128, n_layer=4, seq_len=64, global_batch=8, micro_batch=4, dp=2)),
    (2, dict(d_model=256, n_layer=2, seq_len=128, global_batch=4, micro_batch=2, tp=2)),
    (2, dict(d_model=128, n_layer=8, seq_len=64, global_batch=8, micro_batch=4, pp=2)),
]
# The pipeline's bubble against microbatches: pp=2, one shape, 128-token
# microbatches, 1 to 16 of them per step.
PIPELINE_POINTS = [
    (2, dict(d_model=128, n_layer=4, seq_len=128, global_batch=m, micro_batch=1, pp=2))
    for m in (1, 2, 3, 4, 6, 8, 12, 16)
]
POINT_SETS = {"layouts": POINTS, "pipeline": PIPELINE_POINTS}

KEYS = ["forward_ms", "backward_ms", "optimizer_ms", "data_wait_ms", "dp_comm_ms", "dp_comm_exposed_ms",
        "tp_comm_ms", "pp_bubble_ms", "pp_comm_exposed_ms", "ckpt_stall_ms"]
SECTION = dict(d_model="model", n_layer="model", seq_len="model", global_batch="train", micro_batch="train",
               dp="parallel", tp="parallel", pp="parallel", zero="parallel")


def settings(p):
    return {f"{SECTION[k]}.{k}": v for k, v in p.items()}


def run_point(args, ranks, p, jsonl):
    sets = [f"{k}={v}" for k, v in settings(p).items()]
    sets += [f"data.train={args.data}/train", f"train.steps={args.steps}", f"metrics.jsonl={jsonl}",
             "metrics.peak_tflops=0.05"]
    cmd = [args.xirang, "train", args.config] + sum((["--set", s] for s in sets), [])
    if ranks > 1:
        cmd = ["mpirun", "--oversubscribe", "--allow-run-as-root", "-np", str(ranks)] + cmd
    if args.nice:
        cmd = ["nice", "-n", str(args.nice)] + cmd
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(jsonl) as f:
        return [json.loads(l) for l in f if l.strip()][args.warmup:]


def row(i, ranks, p, steps):
    med = lambda k: statistics.median(s.get(k, 0.0) for s in steps)
    q = lambda frac: sorted(s["step_ms"] for s in steps)[int(frac * (len(steps) - 1))]
    step_ms = med("step_ms")
    br = {k: med(k) for k in KEYS}
    br["unaccounted_ms"] = step_ms - sum(v for k, v in br.items() if k not in ("dp_comm_ms",))
    dp, tp, pp = p.get("dp", 1), p.get("tp", 1), p.get("pp", 1)
    return {"point": i, "id": "-".join(f"{k}{v}" for k, v in sorted(p.items())) + f"-r{ranks}",
            "settings": settings(p), "ranks": ranks, "status": "ok", "reason": "",
            "layout": {"dp": dp, "tp": tp, "pp": pp, "virtual_stages": 1, "schedule": "1f1b", "zero": p.get("zero", 0),
                       "sequence_parallel": False, "micro_batch": p["micro_batch"], "global_batch": p["global_batch"]},
            "model": {"n_layer": p["n_layer"], "d_model": p["d_model"], "n_head": 4, "seq_len": p["seq_len"],
                      "vocab_size": 256},
            "precision": "fp32", "steps_measured": len(steps), "step_ms_median": step_ms,
            "step_ms_p10": q(0.1), "step_ms_p90": q(0.9), "tokens_per_s": med("tokens_per_s"), "mfu": med("mfu"),
            "breakdown_ms": br, "shares": {k[:-3]: v / step_ms for k, v in br.items()},
            "memory_bytes_per_rank": 0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("xirang"); ap.add_argument("data"); ap.add_argument("out")
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "../../configs/gpt2_debug.yaml"))
    ap.add_argument("--passes", type=int, default=3); ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    # On a machine shared with other work, a raised priority (negative
    # niceness, needs root) keeps the ranks on their cores while measured.
    ap.add_argument("--nice", type=int, default=0)
    ap.add_argument("--points", choices=sorted(POINT_SETS), default="layouts")
    args = ap.parse_args()
    points = POINT_SETS[args.points]
    steps = [[] for _ in points]
    with tempfile.TemporaryDirectory() as tmp:
        for ps in range(args.passes):
            for i, (ranks, p) in enumerate(points):
                steps[i] += run_point(args, ranks, p, os.path.join(tmp, f"{i}-{ps}.jsonl"))
                print(f"pass {ps + 1}/{args.passes} point {i}: {statistics.median(s['step_ms'] for s in steps[i]):.1f} ms",
                      file=sys.stderr)
    with open(args.out, "w") as f:
        for i, (ranks, p) in enumerate(points):
            f.write(json.dumps(row(i, ranks, p, steps[i])) + "\n")


if __name__ == "__main__":
    main()
