#!/usr/bin/env bash
# `xirang plan`: bad input gives one error line and a non-zero exit; JSON
# output parses; the planner's memory per rank equals the memory plan the
# trainer prints for the same layout under mpirun; calibration writes a
# cluster file.
# Usage: plan_test.sh XIRANG_BINARY SOURCE_DIR WORK_DIR CASE
set -uo pipefail
xirang=$1 src=$2 work=$3 case=$4
mkdir -p "$work"
cd "$work" || exit 1

. "$src/tests/cli/lib.sh"

cfg=$src/configs/gpt2_debug.yaml
here=$src/configs/clusters/this_machine.yaml
a100=$src/configs/clusters/A100-80GB.yaml

prepare_data() {
  [ -f data/debug/train/index.json ] && return
  "$xirang" data prepare --tokenizer bytes --out data/debug --force "$src/tests/assets/text/english.txt" \
    >/dev/null || die "data prepare failed"
}


# memory_matches RANKS LAYOUT SETS...: the trainer's printed plan (rank 0) and the planner's agree per category.
memory_matches() {
  local ranks=$1 layout=$2; shift 2
  prepare_data
  local sets=(--set data.train=data/debug/train --set train.steps=1 "$@")
  mpirun --oversubscribe --allow-run-as-root -np "$ranks" "$xirang" train "$cfg" "${sets[@]}" >train.txt 2>&1 ||
    die "training failed: $(tail -n 3 train.txt)"
  "$xirang" plan "$cfg" --cluster "$here" --layout "$layout" --explain "${sets[@]}" >plan.txt 2>&1 ||
    die "plan failed: $(cat plan.txt)"
  local cats=(parameters gradients "optimizer state" activations "input batch")
  grep -q "gradient shard" train.txt && cats+=("gradient shard")
  for c in "${cats[@]}"; do
    local t p
    t=$(grep -E "^ +$c +[0-9]" train.txt | head -n 1 | sed -E "s/^ +$c +([0-9.]+ [KMG]?i?B).*/\1/")
    p=$(grep -E "^ +$c +[0-9]" plan.txt | head -n 1 | sed -E "s/^ +$c +([0-9.]+ [KMG]?i?B).*/\1/")
    [ -n "$t" ] || die "no '$c' line in the trainer's plan: $(cat train.txt)"
    [ "$t" = "$p" ] || die "$c: trainer $t, planner $p (layout $layout)"
  done
  echo "ok [$case]: trainer and planner agree for $layout"
}

case $case in
  missing_cluster_option) expect_error 2 "usage error: plan: --cluster" -- plan "$cfg" --gpus 2 ;;
  missing_cluster_key)
    grep -v '^peak_tflops:' "$a100" >bad_cluster.yaml
    expect_error 1 "config error: .*missing key 'peak_tflops'" -- plan "$cfg" --cluster bad_cluster.yaml --gpus 8 ;;
  unknown_cluster_key)
    { cat "$a100"; echo "flux_capacitor: 1"; } >bad_cluster.yaml
    expect_error 1 "config error: .*unknown key 'flux_capacitor'" -- plan "$cfg" --cluster bad_cluster.yaml --gpus 8 ;;
  impossible_layout)
    # tp=8 fits a node but not the model's 4 heads: the model's own rule, as a config error.
    expect_error 1 "config error: --layout tp=8: model.n_head=4 is not divisible by parallel.tp=8" -- \
      plan "$cfg" --cluster "$a100" --layout tp=8 ;;
  unknown_layout_key) expect_error 2 "usage error: --layout: unknown key 'tensor'" -- plan "$cfg" --cluster "$a100" --layout tensor=2 ;;
  unknown_model_key)
    expect_error 1 "config error: .*model.flavour" -- plan "$cfg" --cluster "$a100" --gpus 8 --set model.flavour=1 ;;
  config_cp)
    # The config's parallel.cp is planned: its --layout keeps it, the table and JSON show it.
    "$xirang" plan "$cfg" --cluster "$a100" --set parallel.cp=2 --layout dp=2,tp=2 --explain >out.txt 2>err.txt ||
      die "plan at parallel.cp=2 failed: $(cat err.txt)"
    grep -q "^layout dp=2,cp=2,tp=2," out.txt || die "no cp=2 in the layout: $(cat out.txt)"
    grep -qE "^ +cp_comm +[0-9.e-]+ s" out.txt || die "no cp_comm term: $(cat out.txt)"
    grep -q "cp comm: .* over 2 ranks (intra-node)" out.txt || die "no cp comm note: $(cat out.txt)"
    "$xirang" plan "$cfg" --cluster "$a100" --layout dp=2,cp=4 --json >out.json 2>err.txt || die "$(cat err.txt)"
    python3 - out.json <<'PY' || die "bad JSON: $(head -c 400 out.json)"
import json, sys
l = json.load(open(sys.argv[1]))["layouts"][0]
assert l["layout"]["cp"] == 4 and l["layout"]["dp"] == 2, l["layout"]
assert l["breakdown_s"]["cp_comm_s"] > 0, l["breakdown_s"]
assert abs(sum(l["breakdown_s"].values()) - l["step_s"]) < 1e-9 * l["step_s"]
PY
    echo "ok [$case]" ;;
  bad_cp)
    expect_error 1 "config error: --layout cp=3: model.seq_len=64 is not divisible by 2 x parallel.cp \(3\) = 6: context parallelism cuts each sequence into 2 x cp equal chunks" -- \
      plan "$cfg" --cluster "$a100" --layout cp=3 ;;
  cp_gpus_mismatch)
    expect_error 1 "config error: --layout dp=2,cp=2,tp=2,.* uses 8 devices, not --gpus 4" -- \
      plan "$cfg" --cluster "$a100" --gpus 4 --layout dp=2,cp=2,tp=2 ;;
  gpus_mismatch)
    expect_error 1 "config error: .*uses 4 devices, not --gpus 8" -- plan "$cfg" --cluster "$a100" --gpus 8 --layout dp=2,tp=2 ;;
  json_output)
    "$xirang" plan "$cfg" --cluster "$a100" --gpus 8 --top 3 --json >out.json 2>err.txt || die "plan failed: $(cat err.txt)"
    python3 - out.json <<'PY' || die "bad JSON: $(head -c 400 out.json)"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["devices"] == 8 and 1 <= len(j["layouts"]) <= 3, j
for l in j["layouts"]:
    lay = l["layout"]
    assert lay["dp"] * lay["tp"] * lay["pp"] == 8, lay
    assert l["fits"] and l["memory_bytes"]["total"] > 0 and l["step_s"] > 0 and 0 < l["mfu"] < 1
    assert abs(sum(l["breakdown_s"].values()) - l["step_s"]) < 1e-9 * l["step_s"] + 1e-12
tps = [l["tokens_per_s"] for l in j["layouts"]]
assert tps == sorted(tps, reverse=True), tps
PY
    echo "ok [$case]" ;;
  explain_recompute)
    "$xirang" plan "$cfg" --cluster "$a100" --layout dp=2,tp=2,recompute=full --explain >out.txt 2>err.txt || die "$(cat err.txt)"
    grep -q "recomputation: train.recompute=full" out.txt || die "no recomputation note: $(cat out.txt)"
    echo "ok [$case]" ;;
  memory_one_rank) memory_matches 1 dp=1 --set train.micro_batch=2 ;;
  memory_tp2) memory_matches 2 dp=1,tp=2 --set parallel.tp=2 ;;
  memory_pp2) memory_matches 2 dp=1,pp=2 --set parallel.pp=2 ;;
  memory_dp2_zero) memory_matches 2 dp=2,zero=1 --set parallel.zero=1 --set parallel.bucket_mb=0.01 ;;
  memory_tp2_full)
    memory_matches 2 dp=1,tp=2,recompute=full --set parallel.tp=2 --set train.recompute=full
    grep -qE "activations per microbatch: none [0-9.]+ [KMG]?i?B, selective .*, full .* \(train.recompute=full\)" train.txt ||
      die "no per-mode activation line: $(cat train.txt)" ;;
  memory_pp2_selective) memory_matches 2 dp=1,pp=2 --set parallel.pp=2 --set train.recompute=selective ;;
  memory_cp2) memory_matches 2 dp=1,cp=2 --set parallel.cp=2 ;;
  calibrate)
    "$xirang" plan --calibrate "$src/tests/assets/sweeps/this_machine.jsonl" --cluster "$here" -o fitted.yaml \
      >out.txt 2>err.txt || die "calibrate failed: $(cat err.txt)"
    grep -q "held-out points" out.txt || die "no held-out report: $(cat out.txt)"
    "$xirang" plan "$cfg" --cluster fitted.yaml --gpus 2 >out2.txt 2>err.txt || die "fitted cluster unusable: $(cat err.txt)"
    echo "ok [$case]: $(tail -n 1 out.txt)" ;;
  calibrate_live)
    # A live sweep of this machine (22 two-rank points, every layout and
    # recomputation mode, 5 repeats in rounds), then the fit on its even
    # points predicts the odd
    # ones: each within 15%, median under 10% (docs/performance_model.md).
    # Points that waited for a core (other work on the machine; the spec's
    # priority needs root) measure that waiting, not the model: the case is
    # skipped then, with the reason.
    prepare_data
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    # An unmeasured run first: the first launch of a cold machine (binary and data not yet in the page cache) is slow.
    mpirun --oversubscribe -np 2 "$xirang" train "$cfg" --set data.train=data/debug/train --set train.steps=3 \
      --set parallel.dp=2 --set model.d_model=128 >/dev/null 2>&1 || die "warm-up run failed"
    rm -rf sweep
    "$xirang" sweep "$src/configs/sweeps/calibrate_this_machine.yaml" --out sweep >sweep.txt 2>&1 ||
      die "sweep failed: $(tail -n 5 sweep.txt)"
    "$xirang" plan --calibrate sweep/results.jsonl --cluster "$here" -o sweep/fitted.yaml --holdout odd --json \
      >cal.json 2>err.txt || die "calibrate failed: $(cat err.txt)"
    python3 - cal.json sweep/results.jsonl <<'PY'
import json, statistics, sys
j = json.load(open(sys.argv[1]))
rows = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
assert len(rows) == 22 and all(r["status"] == "ok" for r in rows), [(r["id"], r["status"], r["reason"]) for r in rows]
if j["contended_points"] > 0:
    waits = {r["id"]: r["host"]["cpu_wait_share"] for r in rows}
    print("SKIP: %d point(s) waited for a core over 10%% of their steps: %s" % (j["contended_points"], waits))
    sys.exit(77)
assert len(j["held_out"]) == len(rows) // 2, j  # --holdout odd: every second point
for p in j["held_out"]:
    print("  %-70s measured %7.2f ms predicted %7.2f ms %+6.1f%%" % (p["id"], 1e3 * p["measured_s"], 1e3 * p["predicted_s"],
                                                                   100 * (p["predicted_s"] / p["measured_s"] - 1)))
print("held out: median %.1f%%, max %.1f%%" % (100 * j["held_out_median_error"], 100 * j["held_out_max_error"]))
sys.exit(0 if j["held_out_max_error"] < 0.15 and j["held_out_median_error"] < 0.10 else 1)
PY
    rc=$?
    [ $rc = 77 ] && exit 77
    [ $rc = 0 ] || die "calibration misses the bar (median under 10%, each under 15%)"
    echo "ok [$case]" ;;
  *) die "unknown case $case" ;;
esac
