#!/usr/bin/env bash
# `xirang report` on real runs of gpt2_debug and on hand-written metrics:
# the tables, shares that add up, the unaccounted time, --json, the
# bottleneck and its advice on a run slowed on purpose, the baseline
# comparison and its exit code, the plots, the per-op table
# (metrics.op_profile), the energy line, and bad input.
# Usage: report_test.sh XIRANG_BINARY SOURCE_DIR WORK_DIR CASE
set -uo pipefail
xirang=$1 src=$2 work=$3 case=$4
mkdir -p "$work"
cd "$work" || exit 1

. "$src/tests/cli/lib.sh"

cfg=$src/configs/gpt2_debug.yaml
# Two short runs the cases share: a normal one, and one whose loader reads
# each sample 30 ms late with nothing prefetched, so it waits for data.
prepare_runs() {
  [ -f normal/metrics.jsonl ] && [ -f slow/metrics.jsonl ] && [ normal/metrics.jsonl -nt "$xirang" ] && return
  [ -f data/debug/train/index.json ] ||
    "$xirang" data prepare --tokenizer bytes --out data/debug --force "$src/tests/assets/text/english.txt" >/dev/null ||
    die "data prepare failed"
  local common=(--set data.train=data/debug/train)
  rm -rf normal slow  # the trainer appends to metrics.jsonl
  "$xirang" train "$cfg" "${common[@]}" --set train.steps=6 --set metrics.jsonl=normal/metrics.jsonl \
    >/dev/null 2>err.txt || die "normal run failed: $(cat err.txt)"
  "$xirang" train "$cfg" "${common[@]}" --set train.steps=4 --set data.read_delay_ms=30 --set data.prefetch=false \
    --set metrics.jsonl=slow/metrics.jsonl >/dev/null 2>err.txt || die "slow run failed: $(cat err.txt)"
}

# The part rows of the step-time table: name, ms, share.
part_rows() { sed -n '/^part  *ms  *share$/,/^total /p' "$1" | sed '1d;$d'; }

# Metrics whose numbers are known: step 1 (warm-up) is odd on purpose; steps
# 2-3 split 100 ms as 60 compute, 10 optimizer, 5 data, 4 dp, 3 tp, 2 bubble,
# 1 pp sends, 1 checkpoint: 14 ms unaccounted. An unknown field is ignored.
write_known() {
  local l='"loss":3,"lr":1e-3,"grad_norm":1,"mfu":0.1,"forward_ms":20,"backward_ms":40,"optimizer_ms":10'
  l+=',"data_wait_ms":5,"dp_comm_ms":8,"dp_comm_exposed_ms":4,"tp_comm_ms":3,"pp_bubble_ms":2'
  l+=',"pp_comm_exposed_ms":1,"ckpt_stall_ms":1,"loss_scale":1,"skipped":false,"peak_tflops":1,"peak_source":"x"'
  l+=',"some_future_field":{"a":1}'
  {
    echo "{\"step\":1,\"tokens_per_s\":10,\"step_ms\":900,${l}}"
    echo "{\"step\":2,\"tokens_per_s\":1000,\"step_ms\":100,${l}}"
    echo "{\"step\":3,\"tokens_per_s\":1000,\"step_ms\":100,${l}}"
  } >known.jsonl
}

# Per-op times whose medians are known: step 1 (warm-up) is odd; steps 2-4
# (step_ms 100) have matmul 38, 40 and 45 ms (median 40, 12 calls), attention
# 10, elementwise 5, tp_all_reduce 30 and dp_all_reduce 120 (in flight: more
# than the step). A kind this version does not know is ignored.
write_ops_known() {
  local l='"loss":3,"tokens_per_s":1000,"forward_ms":30,"backward_ms":40,"optimizer_ms":5'
  local c='"op_calls":{"matmul":12,"attention":4,"elementwise":9,"tp_all_reduce":6,"dp_all_reduce":4,"future_op":1}'
  local o=',"attention":10,"elementwise":5,"tp_all_reduce":30,"dp_all_reduce":120,"future_op":7}'
  {
    echo "{\"step\":1,\"step_ms\":900,${l},\"op_ms\":{\"matmul\":800${o},${c}}"
    for sm in 2:38 3:40 4:45; do
      echo "{\"step\":${sm%:*},\"step_ms\":100,${l},\"op_ms\":{\"matmul\":${sm#*:}${o},${c}}"
    done
  } >ops_known.jsonl
}

case $case in
  ops)
    # Known numbers: the compute and communication blocks, medians, shares of the median step, the note.
    write_ops_known
    "$xirang" report ops_known.jsonl >out.txt 2>err.txt || die "report failed: $(cat err.txt)"
    for l in '^per-op time \(metrics.op_profile; median per step over 3 steps, share of the median step 100.000 ms\)$' \
             '^compute op +ms +share +calls$' '^matmul +40\.000 +40\.0% +12$' '^attention +10\.000 +10\.0% +4$' \
             '^elementwise +5\.000 +5\.0% +9$' '^compute total +55\.000 +55\.0%$' '^communication +ms +share +calls$' \
             '^tp_all_reduce +30\.000 +30\.0% +6$' '^dp_all_reduce +120\.000 +120\.0% +4$' \
             '^note: communication is in-flight time, from submission to completion: it overlaps compute'; do
      grep -qE "$l" out.txt || die "no line /$l/ in: $(sed -n '/^per-op/,$p' out.txt)"
    done
    sed -n '/^compute op/,/^compute total/p' out.txt | grep -qE '^(tp_|dp_|future)' && die "a communication or unknown kind among the compute ops"
    "$xirang" report ops_known.jsonl --json >out.json 2>err.txt || die "report --json failed: $(cat err.txt)"
    [ "$(json_eval out.json "[j.ops.steps, j.ops.compute.matmul.ms, j.ops.compute.matmul.calls, j.ops.communication.tp_all_reduce.share, Object.keys(j.ops.compute).join('+')].join(' ')" \
         "' '.join(str(x) for x in [j['ops']['steps'], j['ops']['compute']['matmul']['ms'], j['ops']['compute']['matmul']['calls'], j['ops']['communication']['tp_all_reduce']['share'], '+'.join(j['ops']['compute'])])" |
         sed 's/\.0\b//g')" = "3 40 12 0.3 matmul+attention+elementwise" ] || die "unexpected --json ops: $(head -c 600 out.json)"
    # A run without op times has no table and no ops key.
    write_known
    "$xirang" report known.jsonl >out.txt 2>err.txt || die "report failed: $(cat err.txt)"
    grep -q '^per-op time' out.txt && die "a per-op table without op_ms"
    # A real profiled run: matmul leads the compute ops, which are most of the step on one rank.
    [ -f data/debug/train/index.json ] ||
      "$xirang" data prepare --tokenizer bytes --out data/debug --force "$src/tests/assets/text/english.txt" >/dev/null ||
      die "data prepare failed"
    "$xirang" train "$cfg" --set data.train=data/debug/train --set train.steps=4 --set metrics.op_profile=true \
      --set metrics.jsonl=profiled/metrics.jsonl >/dev/null 2>err.txt || die "profiled run failed: $(cat err.txt)"
    "$xirang" report profiled --json >out.json 2>err.txt || die "report --json failed: $(cat err.txt)"
    read -r first share <<<"$(json_eval out.json \
      "Object.entries(j.ops.compute).sort((a, b) => b[1].ms - a[1].ms)[0][0] + ' ' + j.ops.compute_total.share" \
      "max(j['ops']['compute'].items(), key=lambda kv: kv[1]['ms'])[0] + ' ' + str(j['ops']['compute_total']['share'])")"
    awk -v s="$share" 'BEGIN {exit !(s > 0 && s < 1.05)}' || die "compute ops are $share of the step"
    # The op times are wall times: where the run's thread waited for a core
    # (cpu_wait_ms over 5% of a step after the first: other work on the
    # machine) the order and share measure that waiting, not the ops.
    contended=$(awk 'match($0, /"step_ms":[0-9.e+-]+/) { s = substr($0, RSTART + 10, RLENGTH - 10) }
                     match($0, /"cpu_wait_ms":[0-9.e+-]+/) { w = substr($0, RSTART + 14, RLENGTH - 14); if (NR > 1 && w > 0.05 * s) c++ }
                     END { print c + 0 }' profiled/metrics.jsonl)
    if [ "$contended" = 0 ]; then
      [ "$first" = matmul ] || die "the largest compute op is $first: $(head -c 800 out.json)"
      awk -v s="$share" 'BEGIN {exit !(s > 0.5)}' || die "compute ops are $share of the step"
    else
      echo "note [$case]: $contended step(s) waited for a core; the profiled run's op order and share are not checked"
    fi
    if command -v gnuplot >/dev/null; then
      rm -rf plots_ops
      "$xirang" report profiled --plot plots_ops >out.txt 2>err.txt || die "report --plot failed: $(cat err.txt)"
      [ "$(head -c 8 plots_ops/ops.png | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] || die "no plots_ops/ops.png: $(tail -5 out.txt)"
    fi
    echo "ok [$case]: known medians and shares; profiled run: matmul first, compute ops $share of the step" ;;
  energy)
    # A CPU run has no energy fields; the report says why in one line.
    prepare_runs
    for key in energy_j joules_per_token avg_watts energy_source; do
      grep -q "\"$key\":" normal/metrics.jsonl && die "a CPU run wrote $key: $(head -n 1 normal/metrics.jsonl)"
    done
    grep -q '"backend":"cpu"' normal/metrics.jsonl || die "no backend field: $(head -n 1 normal/metrics.jsonl)"
    "$xirang" report normal >out.txt 2>err.txt || die "report failed: $(cat err.txt)"
    grep -qxF 'energy: not measured (CPU backend: no energy counter on this machine)' out.txt ||
      die "no 'not measured' line: $(grep -i energy out.txt)"
    "$xirang" report normal --json >out.json 2>err.txt || die "report --json failed: $(cat err.txt)"
    [ "$(json_eval out.json "j.energy.measured" "str(j['energy']['measured']).lower()")" = false ] ||
      die "--json energy: $(head -c 600 out.json)"
    # Known readings: step 1 (warm-up) is odd; steps 2-4 have medians 0.003 J/token and 600 W.
    write_known
    sed -n 1p known.jsonl | sed 's/}$/,"backend":"cuda","joules_per_token":9,"avg_watts":9000,"energy_source":"nvml energy counter"}/' >energy.jsonl
    for jw in 2:0.002:500 3:0.004:700 4:0.003:600; do
      IFS=: read -r st jpt w <<<"$jw"
      sed -n 2p known.jsonl | sed "s/\"step\":2,/\"step\":$st,/; s/}\$/,\"backend\":\"cuda\",\"joules_per_token\":$jpt,\"avg_watts\":$w,\"energy_source\":\"nvml energy counter\"}/" >>energy.jsonl
    done
    "$xirang" report energy.jsonl >out.txt 2>err.txt || die "report failed: $(cat err.txt)"
    grep -qxF "energy: 0.003 J/token, 600.0 W (medians over 3 steps; nvml energy counter, rank 0's GPU)" out.txt ||
      die "unexpected energy line: $(grep -i energy out.txt)"
    # A CUDA run without readings (NVML missing), and a file from before the fields.
    sed 's/,"joules_per_token":[^,]*,"avg_watts":[^,]*,"energy_source":"[^"]*"//' energy.jsonl >cuda_none.jsonl
    "$xirang" report cuda_none.jsonl >out.txt 2>err.txt || die "report failed: $(cat err.txt)"
    grep -q '^energy: not measured (CUDA backend, but NVML gave no readings' out.txt ||
      die "unexpected energy line: $(grep -i energy out.txt)"
    "$xirang" report known.jsonl >out.txt 2>err.txt || die "report failed: $(cat err.txt)"
    grep -q '^energy: not measured (the metrics have no joules_per_token' out.txt ||
      die "unexpected energy line: $(grep -i energy out.txt)"
    echo "ok [$case]" ;;
  summary)
    prepare_runs
    "$xirang" report normal >out.txt 2>err.txt || die "report failed: $(cat err.txt)"
    for l in '^steps: 6 \(step 1 skipped as warm-up; 5 summarised\)' '^tokens/s +[0-9.]+ +[0-9.]+ +[0-9.]+$' \
             '^MFU +[0-9.]+%' '^compute \(fwd\+bwd\) ' '^data wait ' '^dp comm \(exposed\) ' '^pipeline bubble ' \
             '^checkpoint stall ' '^unaccounted ' '^bottleneck: '; do
      grep -qE "$l" out.txt || die "no line /$l/ in: $(cat out.txt)"
    done
    [ "$(part_rows out.txt | wc -l)" = 10 ] || die "expected 10 parts: $(part_rows out.txt)"
    part_rows out.txt | awk '{s += $NF} END {if (s < 99.5 || s > 100.5) {print "shares sum to " s; exit 1}}' ||
      die "the shares do not add up to 100%"
    # Unaccounted = step_ms - the named parts (when not negative, the total row is step_ms).
    part_rows out.txt | awk '/^unaccounted/ {u = $(NF-1); next} {n += $(NF-1)} END {print n, u}' >sums.txt
    read -r named unacc <sums.txt
    step_ms=$(sed -n 's/^step_ms (measured) *//p' out.txt)
    awk -v n="$named" -v u="$unacc" -v s="$step_ms" 'BEGIN {d = s - n; if (d < 0) d = 0; exit !(d - u < 0.005 && u - d < 0.005)}' ||
      die "unaccounted $unacc ms is not step_ms $step_ms - named $named"
    echo "ok [$case]: 10 parts, shares sum to 100%, unaccounted $unacc ms" ;;
  known_numbers)
    write_known
    "$xirang" report known.jsonl >out.txt 2>err.txt || die "report failed: $(cat err.txt)"
    grep -qE '^unaccounted +14\.000 +14\.0%$' out.txt || die "unaccounted is not 14 ms / 14%: $(part_rows out.txt)"
    grep -qE '^compute \(fwd\+bwd\) +60\.000 +60\.0%$' out.txt || die "compute is not 60 ms: $(part_rows out.txt)"
    grep -qE '^tokens/s +1000\.0 +1000\.0 +1000\.0$' out.txt || die "the warm-up step was not skipped: $(cat out.txt)"
    grep -qE '^bottleneck: unaccounted \(14\.0%' out.txt || die "wrong bottleneck: $(grep bottleneck out.txt)"
    # Named parts over step_ms: unaccounted shown as 0, said to be negative, shares still sum to 100%.
    sed 's/"step_ms":100,/"step_ms":80,/' known.jsonl >over.jsonl
    "$xirang" report over.jsonl >out.txt 2>err.txt || die "report failed: $(cat err.txt)"
    grep -qE '^unaccounted +0\.000 +0\.0%$' out.txt || die "a negative unaccounted time is shown: $(part_rows out.txt)"
    grep -q 'exceed step_ms by 6.000 ms (unaccounted is negative' out.txt || die "no note on the negative time"
    part_rows out.txt | awk '{s += $NF} END {exit !(s >= 99.5 && s <= 100.5)}' || die "shares do not sum to 100%"
    echo "ok [$case]" ;;
  json)
    prepare_runs
    "$xirang" report normal --json >out.json 2>err.txt || die "report --json failed: $(cat err.txt)"
    sum=$(json_eval out.json "Object.values(j.breakdown).reduce((s, p) => s + p.share, 0)" \
                             "sum(p['share'] for p in j['breakdown'].values())") || die "--json does not parse"
    awk -v s="$sum" 'BEGIN {exit !(s > 0.999999 && s < 1.000001)}' || die "shares sum to $sum, not 1"
    [ "$(json_eval out.json "j.steps + ' ' + j.warmup_skipped + ' ' + (j.tokens_per_s.median > 0)" \
         "'%d %s %s' % (j['steps'], str(j['warmup_skipped']).lower(), str(j['tokens_per_s']['median'] > 0).lower())")" \
       = "6 true true" ] || die "unexpected steps, warm-up or tokens/s: $(head -c 400 out.json)"
    echo "ok [$case]: shares sum to $sum" ;;
  slow_bottleneck)
    prepare_runs
    "$xirang" report slow >out.txt 2>err.txt || die "report failed: $(cat err.txt)"
    grep -qE '^bottleneck: data wait' out.txt || die "data wait is not the bottleneck: $(sed -n '/^step time/,$p' out.txt)"
    grep -q 'data.loader_threads' out.txt || die "no loader advice: $(cat out.txt)"
    # With the run's config, the advice reads its settings: prefetching is off.
    "$xirang" report slow --config "$cfg" --set data.prefetch=false >out.txt 2>err.txt || die "report failed: $(cat err.txt)"
    grep -q 'set data.prefetch=true' out.txt || die "no prefetch advice from the config: $(cat out.txt)"
    echo "ok [$case]" ;;
  bubble_advice)
    # A bubble-bound run: the simulator's numbers for the config's layout (1f1b, pp=4, 8 microbatches).
    write_known
    sed 's/"pp_bubble_ms":2,/"pp_bubble_ms":30,/; s/"step_ms":100,/"step_ms":128,/' known.jsonl >bubble.jsonl
    "$xirang" report bubble.jsonl >out.txt 2>err.txt || die "report failed: $(cat err.txt)"
    grep -q 'needs parallel.pp, parallel.schedule and the microbatch count' out.txt || die "no note on the config: $(cat out.txt)"
    "$xirang" report bubble.jsonl --config "$cfg" --set parallel.pp=4 --set parallel.dp=1 >out.txt 2>err.txt ||
      die "report failed: $(cat err.txt)"
    grep -qE '^bottleneck: pipeline bubble' out.txt || die "bubble is not the bottleneck: $(cat out.txt)"
    grep -q 'simulator predicts 27.3% (analytic 27.3%) for 1f1b, pp=4, 8 microbatches' out.txt ||
      die "no simulator prediction: $(sed -n '/^bottleneck/,$p' out.txt)"
    grep -q '16 microbatches (train.global_batch=16): simulated bubble 15.8%' out.txt || die "no more-microbatch advice"
    grep -q 'parallel.schedule=interleaved with parallel.virtual_stages=2: simulated bubble' out.txt ||
      die "no interleaved advice: $(sed -n '/^bottleneck/,$p' out.txt)"
    # ZB-H1 at p = 4, m = 8 with F = B = W: 3 / (3 x 8 + 3) of the step.
    grep -q 'parallel.schedule=zb_h1 (the backward split, its weight part filling the bubble): simulated bubble 11.1%' out.txt ||
      die "no zb_h1 advice: $(sed -n '/^bottleneck/,$p' out.txt)"
    echo "ok [$case]" ;;
  baseline)
    prepare_runs
    "$xirang" report slow --baseline normal >out.txt 2>err.txt || die "report --baseline exited $? without --fail-on-regression"
    grep -qE '^data wait .*REGRESSION$' out.txt || die "data wait not flagged: $(sed -n '/^baseline/,$p' out.txt)"
    grep -qE '^tokens/s \(median\) .*-[0-9.]+%  REGRESSION$' out.txt || die "tokens/s not flagged"
    grep -qE '^regressions: .*data wait' out.txt || die "no regression summary"
    "$xirang" report slow --baseline normal --fail-on-regression >out.txt 2>err.txt
    rc=$?; [ "$rc" = 3 ] || die "--fail-on-regression exited $rc, expected 3"
    "$xirang" report normal --baseline normal --fail-on-regression >out.txt 2>err.txt ||
      die "a run against itself regressed: $(sed -n '/^baseline/,$p' out.txt)"
    grep -q '^regressions: none' out.txt || die "a run against itself flags: $(grep regressions out.txt)"
    echo "ok [$case]" ;;
  plot)
    prepare_runs
    command -v gnuplot >/dev/null || { echo "SKIP [$case]: gnuplot missing (tools/setup.sh installs gnuplot-nox)"; exit 77; }
    rm -rf plots
    "$xirang" report normal --plot plots >out.txt 2>err.txt || die "report --plot failed: $(cat err.txt)"
    for f in step_breakdown tokens_per_s loss; do
      [ -s plots/$f.png ] || die "plots/$f.png missing or empty: $(cat out.txt)"
      [ "$(head -c 8 plots/$f.png | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] || die "plots/$f.png is not a PNG"
    done
    # Without gnuplot: the text report, and one line saying why there are no plots.
    PATH=/nonexistent "$xirang" report normal --plot plots2 >out.txt 2>err.txt || die "report failed without gnuplot"
    [ "$(grep -c '^plots skipped: gnuplot not found' out.txt)" = 1 ] || die "no skip line: $(tail -3 out.txt)"
    grep -q '^bottleneck: ' out.txt || die "no text report without gnuplot"
    echo "ok [$case]" ;;
  bad_input)
    expect_error 1 "data error: .*no_such_run.*does not exist" -- report no_such_run
    mkdir -p empty_dir
    expect_error 1 "data error: .*empty_dir.*no metrics.jsonl" -- report empty_dir
    printf '{"step":1,"step_ms":5}\nthis is not json\n' >garbage.jsonl
    expect_error 1 "data error: .*garbage.jsonl line 2 is not a JSON object" -- report garbage.jsonl
    : >empty.jsonl
    expect_error 1 "data error: .*empty.jsonl holds no steps" -- report empty.jsonl
    echo '{"event":"start"}' >nosteps.jsonl
    expect_error 1 "data error: .*nosteps.jsonl holds no steps" -- report nosteps.jsonl
    expect_error 2 "usage error: .*no run given" -- report
    expect_error 2 "usage error: .*unknown option '--frobnicate'" -- report empty.jsonl --frobnicate
    expect_error 2 "usage error: .*--tolerance 'lots'" -- report empty.jsonl --tolerance lots
    write_known
    expect_error 1 "config error: .*no_such.yaml" -- report known.jsonl --config no_such.yaml ;;
  *) die "unknown case" ;;
esac
