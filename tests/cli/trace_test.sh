#!/usr/bin/env bash
# Timeline traces (metrics.trace) and `xirang trace merge`, on one traced
# run of gpt2_debug on 8 ranks (dp2 x tp2 x pp2, 1f1b, steps 2-4 traced,
# a checkpoint save and an evaluation at step 3):
#   merge_checks       the merged file against the layout and rank 0's metrics.jsonl (trace_check.js)
#   checker_mutations  trace_check.js rejects a merged file broken in each way it checks
#   bad_input          merge's errors: one line naming the file, exit 1
#   report             `xirang report` prints each rank's utilisation (text, --json, --plot)
# Usage: trace_test.sh XIRANG_BINARY SOURCE_DIR WORK_DIR CASE
# Exit 77: node or mpirun is missing.
set -uo pipefail
xirang=$1 src=$2 work=$3 case=$4
mkdir -p "$work"
cd "$work" || exit 1

. "$src/tests/cli/lib.sh"

command -v node >/dev/null || { echo "SKIP [$case]: node is missing (tools/setup.sh installs it)"; exit 77; }
check_js=$src/tests/cli/trace_check.js

# The traced run the cases share: run/metrics.jsonl, run/trace/rank_*.json.
prepare_run() {
  [ -f run/trace/rank_00007.json ] && [ -f run/metrics.jsonl ] && [ run/metrics.jsonl -nt "$xirang" ] && return
  command -v mpirun >/dev/null || { echo "SKIP [$case]: mpirun is missing"; exit 77; }
  rm -rf run
  [ -f data/debug/val/index.json ] ||
    "$xirang" data prepare --tokenizer bytes --val-fraction 0.1 --out data/debug --force \
      "$src/tests/assets/text/english.txt" >/dev/null || die "data prepare failed"
  env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -np 8 --oversubscribe \
    "$xirang" train "$src/configs/gpt2_debug.yaml" --set data.train=data/debug/train --set data.val=data/debug/val \
    --set parallel.dp=2 --set parallel.tp=2 --set parallel.pp=2 --set parallel.schedule=1f1b --set train.steps=6 \
    --set train.eval_every=3 --set checkpoint.dir=run/ckpt --set checkpoint.every=3 \
    --set metrics.trace=run/trace --set metrics.trace_steps=2-4 --set metrics.jsonl=run/metrics.jsonl \
    >train.out 2>&1 || die "traced run failed: $(tail -5 train.out)"
}

merged() {
  prepare_run
  [ -f run/trace/trace.json ] || "$xirang" trace merge run/trace >merge.out 2>&1 || die "merge failed: $(cat merge.out)"
}

# mutate JS: a copy of the merged trace with JS applied to `t`, in bad.json.
mutate() {
  node -e "const fs = require('fs'); const t = JSON.parse(fs.readFileSync('run/trace/trace.json', 'utf8'));
           $1; fs.writeFileSync('bad.json', JSON.stringify(t))" || die "mutation failed: $1"
}

# expect_rejected WHAT PATTERN [METRICS]: trace_check.js fails on bad.json
# (and run/metrics.jsonl, or METRICS) with a line matching PATTERN.
expect_rejected() {
  node "$check_js" bad.json "${3:-run/metrics.jsonl}" >check.out 2>&1 && die "the checker accepted a trace with $1"
  grep -qE "$2" check.out || die "the checker failed on $1 without /$2/: $(head -3 check.out)"
  echo "ok [$case]: $1 -> $(grep -E "$2" check.out | head -1)"
}

# A copy of the rank files in bad/, for merge's bad-input cases.
fresh_copy() { rm -rf bad && mkdir bad && cp run/trace/rank_*.json bad/; }
# edit FILE JS: applies JS to the rank file's object `t`.
edit() {
  node -e "const fs = require('fs'); const t = JSON.parse(fs.readFileSync('$1', 'utf8'));
           $2; fs.writeFileSync('$1', JSON.stringify(t))" || die "edit failed: $2"
}

case $case in
  merge_checks)
    prepare_run
    rm -f run/trace/trace.json
    "$xirang" trace merge run/trace >merge.out 2>err.txt || die "merge failed: $(cat err.txt)"
    grep -qE '^merged 8 ranks, [0-9]+ spans, steps 2-4, max clock offset [0-9.]+ ms -> run/trace/trace.json$' merge.out ||
      die "unexpected summary: $(cat merge.out)"
    [ -z "$(ls run/trace/*.tmp 2>/dev/null)" ] || die "a temp file was left behind"
    node "$check_js" run/trace/trace.json run/metrics.jsonl || die "the merged trace fails its checks"
    # -o elsewhere gives the same file.
    "$xirang" trace merge run/trace -o other.json >/dev/null 2>err.txt || die "merge -o failed: $(cat err.txt)"
    cmp -s other.json run/trace/trace.json || die "merge -o wrote a different file"
    echo "ok [$case]: $(cat merge.out)" ;;
  checker_mutations)
    merged
    mutate "t.traceEvents.find(e => e.ph === 'X' && e.name === 'forward').dur = -5"
    expect_rejected "a negative duration" 'bad ts, dur or pid'
    mutate "t.traceEvents.find(e => e.ph === 'X').ts = null"
    expect_rejected "a missing timestamp" 'bad ts, dur or pid'
    mutate "t.traceEvents = t.traceEvents.filter(e => e.pid !== 3)"
    expect_rejected "a rank's events dropped" '7 processes, expected 8'
    mutate "t.traceEvents.find(e => e.name === 'process_name' && e.pid === 5).args.name = 'rank 5 (dp 0, tp 0, pp 0)'"
    expect_rejected "a process misnamed" 'process 5 is named'
    mutate "const e = t.traceEvents.find(e => e.pid === 1 && e.name === 'send_activation'); const c = Object.assign({}, e);
            c.ts += c.dur / 2; t.traceEvents.push(c)"
    expect_rejected "two overlapping sends on one lane" 'process/thread 1/[0-9]+: send_activation .* overlaps send_activation'
    mutate "const f = t.traceEvents.find(e => e.pid === 0 && e.name === 'forward'); f.dur += 1; f.ts -= f.dur / 2"
    expect_rejected "a forward crossing its neighbour" 'process/thread 0/1: .* without nesting'
    mutate "t.otherData.ranks[6].clock_offset_us = 80000"
    expect_rejected "a skewed clock" "rank 6's clock offset"
    mutate "const i = t.traceEvents.findIndex(e => e.pid === 2 && e.name === 'step' && e.args.step === 4); t.traceEvents.splice(i, 1)"
    expect_rejected "a step span dropped" 'rank 2 has step spans \[2,3\]'
    mutate "t.traceEvents.find(e => e.pid === 0 && e.name === 'step' && e.args.step === 3).dur *= 1.2"
    expect_rejected "a step span 20% long" 'step 3: step: spans'
    # Lengthened by a fifth of the longest step (the tolerance is 5% of step_ms, however loaded the machine is).
    longest="Math.max(...t.traceEvents.filter(e => e.pid === 0 && e.name === 'step').map(e => e.dur))"
    mutate "const d = 0.2 * $longest; for (const e of t.traceEvents) if (e.pid === 0 && e.name === 'data_wait') e.dur += d"
    expect_rejected "data waits a fifth of a step long" 'data_wait: spans'
    mutate "t.traceEvents = t.traceEvents.filter(e => !(e.pid === 0 && e.name === 'checkpoint_save'))"
    expect_rejected "the checkpoint save dropped" 'rank 0 has no checkpoint_save|checkpoint_save: spans'
    mutate "t.traceEvents = t.traceEvents.filter(e => !(e.pid === 4 && e.name === 'dp_all_reduce'))"
    expect_rejected "a rank's dp reductions dropped" 'rank 4 has no dp_all_reduce'
    mutate "const d = 0.2 * $longest; for (const e of t.traceEvents) if (e.pid === 0 && e.name === 'optimizer') e.dur += d"
    expect_rejected "optimizer spans a fifth of a step long" 'optimizer less nested dp_wait'
    mutate "t.traceEvents = t.traceEvents.filter(e => !(e.pid === 0 && e.name.startsWith('tp_')))"
    expect_rejected "rank 0's tp collectives dropped" 'tp collectives: spans'
    mutate "t.traceEvents = t.traceEvents.filter(e => !(e.pid === 0 && e.name === 'wait_gradient'))"
    expect_rejected "rank 0's pipeline waits dropped" 'bubble: pipeline waits'
    mutate "t.traceEvents = t.traceEvents.filter(e => !(e.pid === 1 && e.name === 'eval'))"
    expect_rejected "rank 1's evaluation dropped" 'rank 1 has no eval span'
    mutate "t.traceEvents = t.traceEvents.filter(e => !(e.pid === 7 && (e.cat || '').startsWith('pp sends')))"
    expect_rejected "rank 7's pp sends dropped" 'rank 7 has no pp send span'
    # A rank whose clock reference is 100 ms off: the merge shows the offset and shifts the rank.
    fresh_copy; edit bad/rank_00003.json "t.otherData.clock_sync_us -= 1e5"
    "$xirang" trace merge bad -o bad.json >/dev/null 2>err.txt || die "merge failed: $(cat err.txt)"
    expect_rejected "a skewed clock_sync_us" "rank 3's clock offset is -[0-9]{5}"
    grep -qE "rank 3's step 2 starts at [0-9]{5}" check.out || die "the skewed rank's steps were not shifted: $(cat check.out)"
    # The metrics side: forward_ms a fifth of the step too long on step 4.
    cp run/trace/trace.json bad.json
    node -e "const fs = require('fs'); const out = fs.readFileSync('run/metrics.jsonl', 'utf8').split('\n').map(l => {
      if (!l.trim()) return l; const m = JSON.parse(l); if (m.step === 4) m.forward_ms += 0.2 * m.step_ms; return JSON.stringify(m); });
      fs.writeFileSync('bad_metrics.jsonl', out.join('\n'))" || die "metrics mutation failed"
    expect_rejected "forward_ms a fifth of a step long" 'step 4: forward\+backward less nested tp and tied' bad_metrics.jsonl ;;
  bad_input)
    prepare_run
    expect_error 1 "data error: trace: 'no_such_dir' does not exist" -- trace merge no_such_dir
    mkdir -p empty
    expect_error 1 "data error: trace: 'empty' holds no rank_\*\.json files" -- trace merge empty
    fresh_copy; rm bad/rank_00003.json
    expect_error 1 "data error: trace: bad: rank 3 of world_size 8 is missing \(no rank_00003.json\)" -- trace merge bad
    [ ! -f bad/trace.json ] || die "a failed merge wrote bad/trace.json"
    fresh_copy; printf '{"traceEvents": [' >bad/rank_00002.json
    expect_error 1 "data error: trace: bad/rank_00002.json is not valid JSON" -- trace merge bad
    fresh_copy; edit bad/rank_00004.json "t.otherData.format = 'xirang-trace-0'"
    expect_error 1 'data error: trace: bad/rank_00004.json: format "xirang-trace-0", expected "xirang-trace-1"' -- trace merge bad
    fresh_copy; cp bad/rank_00001.json bad/rank_1.json
    expect_error 1 "data error: trace: bad/rank_1.json and bad/rank_00001.json both hold rank 1" -- trace merge bad
    fresh_copy; mv bad/rank_00001.json bad/rank_00009.json
    expect_error 1 "data error: trace: bad/rank_00009.json holds rank 1 \(expected 9 from its name\)" -- trace merge bad
    fresh_copy; edit bad/rank_00005.json "t.otherData.world_size = 4"
    expect_error 1 "data error: trace: bad/rank_00005.json: world_size 4 differs from bad/rank_00000.json's 8" -- trace merge bad
    fresh_copy; edit bad/rank_00006.json "t.otherData.last_step = 5"
    expect_error 1 "data error: trace: bad/rank_00006.json: steps 2-5 differs from bad/rank_00000.json's 2-4" -- trace merge bad
    fresh_copy; edit bad/rank_00007.json "delete t.otherData.clock_sync_us"
    expect_error 1 "data error: trace: bad/rank_00007.json: otherData.clock_sync_us is missing" -- trace merge bad
    fresh_copy; edit bad/rank_00002.json "t.traceEvents.find(e => e.ph === 'X').dur = -1"
    expect_error 1 "data error: trace: bad/rank_00002.json: traceEvents\[[0-9]+\] is a complete event without .* dur >= 0" -- trace merge bad
    expect_error 2 "usage error: trace merge: no directory given" -- trace merge
    expect_error 2 "usage error: trace: unknown subcommand 'split'" -- trace split run/trace
    expect_error 2 "usage error: trace merge: -o needs a file name" -- trace merge run/trace -o ;;
  report)
    merged
    "$xirang" report run >out.txt 2>err.txt || die "report failed: $(cat err.txt)"
    grep -q '^utilisation over traced steps 2-4 (trace: run/trace)' out.txt || die "no utilisation table: $(tail -12 out.txt)"
    rows=$(sed -n '/^rank (dp,tp,pp) /,/^$/p' out.txt | grep -E '^[0-9]+ \([0-9],[0-9],[0-9]\) ')
    [ "$(echo "$rows" | wc -l)" = 8 ] || die "expected 8 rank rows: $rows"
    # Each row: rank, coordinates, step ms, then 10 shares in % that sum to 100.
    echo "$rows" | tr -d '%' | awk '{s = 0; for (i = 4; i <= NF; ++i) { if ($i < 0 || $i > 100) exit 1; s += $i }
                                    if (NF != 13 || s < 99.5 || s > 100.5) exit 1}' || die "bad shares: $rows"
    "$xirang" report run --json >out.json 2>err.txt || die "report --json failed: $(cat err.txt)"
    node -e "const u = JSON.parse(require('fs').readFileSync('out.json', 'utf8')).utilisation;
      if (!u || u.ranks.length !== 8 || u.first_step !== 2 || u.last_step !== 4) throw new Error('no utilisation for 8 ranks');
      for (const r of u.ranks) {
        const shares = Object.values(r.parts).map(p => p.share);
        if (shares.length !== 10 || shares.some(s => !(s >= 0 && s <= 1))) throw new Error('rank ' + r.rank + ': share outside [0,1]');
        const sum = shares.reduce((a, b) => a + b, 0);
        if (Math.abs(sum - 1) > 1e-6 || r.steps !== 3 || !(r.step_ms > 0)) throw new Error('rank ' + r.rank + ': shares sum to ' + sum);
      }" 2>err.txt || die "--json utilisation: $(grep "^Error" err.txt | head -1)"
    # Rank 0's parts against its metrics.jsonl over the traced steps (each part's mean within 5% of the step).
    node -e "const fs = require('fs'); const u = JSON.parse(fs.readFileSync('out.json', 'utf8')).utilisation.ranks[0];
      const rows = fs.readFileSync('run/metrics.jsonl', 'utf8').split('\n').filter(l => l.trim()).map(JSON.parse)
        .filter(m => m.step >= 2 && m.step <= 4);
      const mean = f => rows.reduce((s, m) => s + f(m), 0) / rows.length;
      const want = { compute: m => m.forward_ms + m.backward_ms, optimizer: m => m.optimizer_ms, data_wait: m => m.data_wait_ms,
        dp_comm_exposed: m => m.dp_comm_exposed_ms, tp_comm: m => m.tp_comm_ms, pp_bubble: m => m.pp_bubble_ms,
        pp_comm_exposed: m => m.pp_comm_exposed_ms, ckpt_stall: m => m.ckpt_stall_ms };
      const tol = 0.05 * mean(m => m.step_ms);
      if (Math.abs(u.step_ms - mean(m => m.step_ms)) > tol) throw new Error('step_ms ' + u.step_ms);
      for (const [k, f] of Object.entries(want))
        if (Math.abs(u.parts[k].ms - mean(f)) > tol)
          throw new Error(k + ': ' + u.parts[k].ms.toFixed(3) + ' ms from the trace, ' + mean(f).toFixed(3) + ' in metrics.jsonl');
      " 2>err.txt || die "rank 0's utilisation disagrees with metrics.jsonl: $(grep "^Error" err.txt | head -1)"
    # The merged file gives the same numbers as the rank files (up to the rounding of the shifted times).
    "$xirang" report run --json --trace run/trace/trace.json >out2.json 2>err.txt || die "report --trace failed: $(cat err.txt)"
    node -e "const f = n => JSON.parse(require('fs').readFileSync(n, 'utf8')).utilisation.ranks;
      const a = f('out.json'), b = f('out2.json');
      a.forEach((r, i) => Object.keys(r.parts).forEach(k => {
        if (Math.abs(r.parts[k].ms - b[i].parts[k].ms) > 1e-3) throw new Error('rank ' + i + ' ' + k + ': ' +
          r.parts[k].ms + ' ms from the rank files, ' + b[i].parts[k].ms + ' from the merged file');
      }))" 2>err.txt || die "the merged trace and the rank files disagree: $(grep "^Error" err.txt | head -1)"
    expect_error 1 "data error: trace: 'nowhere' does not exist" -- report run --trace nowhere
    # A broken trace beside the run is a note; the metrics still make a report.
    rm -rf broken && mkdir -p broken/trace && cp run/metrics.jsonl broken/ && cp run/trace/rank_0000[0-6].json broken/trace/
    "$xirang" report broken >out.txt 2>err.txt || die "report on a run with a broken trace failed: $(cat err.txt)"
    grep -q '^utilisation skipped: trace: broken/trace: rank 7 of world_size 8 is missing' out.txt ||
      die "no note on the broken trace: $(tail -3 out.txt)"
    if command -v gnuplot >/dev/null; then
      rm -rf plots
      "$xirang" report run --plot plots >out.txt 2>err.txt || die "report --plot failed: $(cat err.txt)"
      [ "$(head -c 8 plots/utilisation.png 2>/dev/null | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] ||
        die "plots/utilisation.png is not a PNG: $(tail -3 out.txt)"
    fi
    echo "ok [$case]: $(echo "$rows" | head -1)" ;;
  *) die "unknown case" ;;
esac
