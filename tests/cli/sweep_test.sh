#!/usr/bin/env bash
# `xirang sweep` on a 4-point sweep of gpt2_debug: two points measured (1 and
# 2 ranks), one refused by config validation (tp=3 on 2 ranks), one over its
# memory limit (memory.limit_gb); --resume runs nothing again; the plots; the
# CSV; --dry-run; a point that hangs and is killed at its timeout; bad input.
# Usage: sweep_test.sh XIRANG_BINARY SOURCE_DIR WORK_DIR CASE
#
#   measured   statuses, reasons, positive medians and memory, layout fields, progress lines
#   resume     --resume launches nothing and leaves every run's files as they were; a row
#              removed from results.jsonl is the one point run again
#   csv        results.csv parses (a quoted reason with commas) and matches results.jsonl
#   plots      tokens_per_s, step_breakdown and scaling PNGs (77 without gnuplot)
#   dry_run    the points and their launch commands, nothing run or written
#   timeout    a hanging point is recorded as timeout and its processes are gone; so are they when
#              the sweep itself is stopped with SIGTERM
#   rounds     repeat_order: rounds runs every point's first repeat, then every point's second;
#              each row pools both repeats
#   bad_input  malformed specs and arguments: one error line, non-zero exit
set -uo pipefail
xirang=$1 src=$2 work=$3 case=$4
mkdir -p "$work"
cd "$work" || exit 1

. "$src/tests/cli/lib.sh"

skip() { echo "SKIP [$case]: $*"; exit 77; }
command -v mpirun >/dev/null || skip "mpirun is not installed"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# The spec: a template launcher that counts its launches in launches.txt.
write_spec() {
  cat >spec.yaml <<EOF
base: $src/configs/gpt2_debug.yaml
set:
  data.train: data/debug/train
  metrics.peak_tflops: 1
points:
  - {ranks: 1}
  - {ranks: 2, parallel.tp: 3}
  - {ranks: 2, parallel.pp: 2, memory.limit_gb: 0.0001}
  - {ranks: 2}
steps: 4
warmup: 1
timeout_s: 120
launcher: "echo {id} >>launches.txt; mpirun -np {ranks} --oversubscribe {xirang} {args}"
env: {OMP_NUM_THREADS: "1"}
EOF
}

prepare_data() {
  [ -f data/debug/train/index.json ] ||
    "$xirang" data prepare --tokenizer bytes --out data/debug --force "$src/tests/assets/text/english.txt" >/dev/null ||
    die "data prepare failed"
}

prepare_sweep() {
  [ -f out/results.csv ] && [ -f out/summary.txt ] && [ out/results.csv -nt "$xirang" ] && return
  prepare_data
  write_spec
  rm -rf out launches.txt
  "$xirang" sweep spec.yaml --out out >sweep.txt 2>sweep.err || die "sweep failed: $(cat sweep.err)"
}

# jsonl_eval FILE JS PY: the expression over `rows` (the file's JSON lines), with node or python3.
jsonl_eval() {
  if command -v node >/dev/null; then
    node -e "const rows = require('fs').readFileSync('$1', 'utf8').trim().split('\n').map(JSON.parse); console.log($2)"
  elif command -v python3 >/dev/null; then
    python3 -c "import json; rows = [json.loads(l) for l in open('$1')]; print($3)"
  else
    skip "neither node nor python3"
  fi
}

# csv_eval FILE JS PY: the expression over `rows` (the CSV's records as objects), with a
# quote-aware reader: node's below, or python3's csv module.
csv_eval() {
  if command -v python3 >/dev/null; then
    python3 -c "import csv; rows = list(csv.DictReader(open('$1', newline=''))); print($3)"
  elif command -v node >/dev/null; then
    node -e "
      const t = require('fs').readFileSync('$1', 'utf8'); const recs = []; let rec = [], f = '', q = false;
      for (let i = 0; i < t.length; ++i) { const c = t[i];
        if (q) { if (c == '\"' && t[i + 1] == '\"') { f += c; ++i; } else if (c == '\"') q = false; else f += c; }
        else if (c == '\"') q = true; else if (c == ',') { rec.push(f); f = ''; }
        else if (c == '\n') { rec.push(f); recs.push(rec); rec = []; f = ''; } else f += c; }
      if (q) throw new Error('unterminated quote');
      const head = recs.shift(); if (recs.some(r => r.length != head.length)) throw new Error('ragged rows');
      const rows = recs.map(r => Object.fromEntries(head.map((h, i) => [h, r[i]]))); console.log($2)"
  else
    skip "neither node nor python3"
  fi
}

status_of() { jsonl_eval out/results.jsonl "rows.find(r => r.point == $1).status" "[r for r in rows if r['point'] == $1][0]['status']"; }
reason_of() { jsonl_eval out/results.jsonl "rows.find(r => r.point == $1).reason" "[r for r in rows if r['point'] == $1][0]['reason']"; }

case $case in
  measured)
    prepare_sweep
    [ "$(wc -l <out/results.jsonl)" = 4 ] || die "expected 4 rows: $(cat out/results.jsonl)"
    for p in 1 4; do [ "$(status_of $p)" = ok ] || die "point $p: $(status_of $p): $(reason_of $p)"; done
    [ "$(status_of 2)" = refused ] || die "point 2 is $(status_of 2), expected refused"
    reason_of 2 | grep -q "^config error: .*world size 2 is not divisible by .*parallel.tp (3)" ||
      die "point 2's reason: $(reason_of 2)"
    [ "$(status_of 3)" = oom ] || die "point 3 is $(status_of 3), expected oom: $(reason_of 3)"
    reason_of 3 | grep -q "^memory error: the memory plan needs .* but memory.limit_gb allows" ||
      die "point 3's reason: $(reason_of 3)"
    # Positive medians and memory on the measured points; none on the others.
    pos='["step_ms_median","step_ms_p10","step_ms_p90","tokens_per_s","mfu","memory_bytes_per_rank"]'
    ok=$(jsonl_eval out/results.jsonl \
      "rows.filter(r => r.status == 'ok').every(r => $pos.every(k => r[k] > 0) && r.steps_measured == 3 && r.breakdown_ms.forward_ms > 0 && r.shares.backward > 0 && r.shares.backward < 1)" \
      "all(all(r[k] > 0 for k in $pos) and r['steps_measured'] == 3 and r['breakdown_ms']['forward_ms'] > 0 and 0 < r['shares']['backward'] < 1 for r in rows if r['status'] == 'ok')")
    [ "$ok" = true ] || [ "$ok" = True ] || die "a measured row lacks positive statistics: $(cat out/results.jsonl)"
    none=$(jsonl_eval out/results.jsonl "rows.filter(r => r.status != 'ok').every(r => r.step_ms_median === null)" \
      "all(r['step_ms_median'] is None for r in rows if r['status'] != 'ok')")
    [ "$none" = true ] || [ "$none" = True ] || die "a refused or oom row has statistics"
    lay=$(jsonl_eval out/results.jsonl "(r => [r.layout.dp, r.layout.pp, r.model.n_layer, r.precision, r.ranks, JSON.stringify(r.settings)].join(' '))(rows.find(r => r.point == 3))" \
      "(lambda r: ' '.join(str(x) for x in [r['layout']['dp'], r['layout']['pp'], r['model']['n_layer'], r['precision'], r['ranks'], json.dumps(r['settings'], separators=(',', ':'))]))([r for r in rows if r['point'] == 3][0])")
    [ "$lay" = '1 2 8 fp32 2 {"parallel.pp":2,"memory.limit_gb":0.0001}' ] || die "point 3's layout, model, precision, ranks, settings: $lay"
    grep -qE '^\[4/4\] ranks2 \(ranks 2\): ok, [0-9.]+ ms/step .* \| elapsed [0-9:]+, ETA 0:00:00$' sweep.txt ||
      die "no progress line for point 4: $(cat sweep.txt)"
    [ "$(wc -l <launches.txt)" = 3 ] || die "expected 3 launches (the refused point is not launched): $(cat launches.txt)"
    echo "ok [$case]: 2 measured, 1 refused, 1 over its memory limit; 3 launches" ;;
  resume)
    prepare_sweep
    # On a copy of the sweep, in a folder of its own: the other cases keep theirs as it was.
    rm -rf resume && mkdir resume && cp -r out spec.yaml launches.txt resume/ && ln -s ../data resume/data &&
      cd resume || die "cannot copy the sweep"
    before=$(wc -l <launches.txt) || die "no launches.txt"
    [ "$before" -ge 3 ] || die "expected the sweep's 3 launches or more in launches.txt, got $before"
    stamps=$(stat -c '%n %Y.%y' out/points/*/metrics.jsonl out/points/*/train.log | sort)
    rows=$(cat out/results.jsonl)
    "$xirang" sweep spec.yaml --out out --resume >resume.txt 2>resume.err || die "resume failed: $(cat resume.err)"
    [ "$(wc -l <launches.txt)" = "$before" ] || die "--resume launched again: $(cat launches.txt)"
    [ "$(stat -c '%n %Y.%y' out/points/*/metrics.jsonl out/points/*/train.log | sort)" = "$stamps" ] ||
      die "--resume touched a run's files"
    [ "$(cat out/results.jsonl)" = "$rows" ] || die "--resume changed results.jsonl"
    [ "$(grep -c ': recorded earlier (' resume.txt)" = 4 ] || die "expected 4 points recorded earlier: $(cat resume.txt)"
    # Without --resume the sweep refuses to overwrite.
    expect_error 2 "out/results.jsonl already exists \(--resume continues" -- sweep spec.yaml --out out
    # A row removed (as a sweep killed mid-point leaves it): that point alone runs again.
    cp out/results.jsonl results.bak
    grep -v '"id":"ranks1"' results.bak >out/results.jsonl
    "$xirang" sweep spec.yaml --out out --resume >resume2.txt 2>resume.err || die "resume failed: $(cat resume.err)"
    [ "$(wc -l <launches.txt)" = $((before + 1)) ] && [ "$(tail -1 launches.txt)" = ranks1 ] ||
      die "expected ranks1 alone to run again: $(cat launches.txt)"
    [ "$(status_of 1)" = ok ] || die "point 1 after the rerun: $(status_of 1)"
    echo "ok [$case]: --resume launched nothing ($before launches before and after); a removed row ran again alone" ;;
  csv)
    prepare_sweep
    n=$(csv_eval out/results.csv "rows.length" "len(rows)")
    [ "$n" = 4 ] || die "results.csv has $n records: $(cat out/results.csv)"
    got=$(csv_eval out/results.csv "rows.map(r => r.status).join(' ')" "' '.join(r['status'] for r in rows)")
    [ "$got" = "ok refused oom ok" ] || die "statuses in the CSV: $got"
    # The oom reason has commas and parentheses: it must come back whole.
    csv_reason=$(csv_eval out/results.csv "rows[2].reason" "rows[2]['reason']")
    [ "$csv_reason" = "$(reason_of 3)" ] || die "the CSV's reason differs: '$csv_reason' vs '$(reason_of 3)'"
    ok=$(csv_eval out/results.csv "rows[3].tp == '1' && rows[3].dp == '2' && +rows[3].step_ms_median > 0 && +rows[3].share_forward > 0 && rows[1].step_ms_median == ''" \
      "rows[3]['tp'] == '1' and rows[3]['dp'] == '2' and float(rows[3]['step_ms_median']) > 0 and float(rows[3]['share_forward']) > 0 and rows[1]['step_ms_median'] == ''")
    [ "$ok" = true ] || [ "$ok" = True ] || die "the CSV's columns do not match the rows: $(cat out/results.csv)"
    echo "ok [$case]: 4 records, statuses and the quoted reason read back" ;;
  plots)
    command -v gnuplot >/dev/null || skip "gnuplot is not installed"
    prepare_sweep
    for f in tokens_per_s step_breakdown scaling; do
      [ "$(head -c 4 "out/plots/$f.png" | od -An -c | tr -d ' ')" = "211PNG" ] || die "out/plots/$f.png is not a PNG"
      grep -q "out/plots/$f.png" sweep.txt || die "$f.png is not listed in: $(cat sweep.txt)"
    done
    grep -q '^strong, global_batch 8' out/summary.txt || die "no strong-scaling series in: $(cat out/summary.txt)"
    echo "ok [$case]: 3 plots, a strong-scaling series of 1 and 2 ranks" ;;
  dry_run)
    # In a folder of its own: the template's launches.txt there must stay absent.
    prepare_data
    mkdir -p dry_run && cd dry_run && ln -sfn ../data data || die "no dry_run folder"
    write_spec
    rm -rf dry launches.txt
    "$xirang" sweep spec.yaml --out dry --dry-run >out.txt 2>err.txt || die "dry run failed: $(cat err.txt)"
    [ "$(grep -c '^\[[1-4]/4\] ' out.txt)" = 4 ] || die "expected 4 points: $(cat out.txt)"
    grep -q "^\[2/4\] ranks2-tp3 (ranks 2): refused: config error: " out.txt || die "point 2 not refused: $(cat out.txt)"
    grep -q "^\[4/4\] ranks2 (ranks 2): echo ranks2 >>launches.txt; mpirun -np 2 --oversubscribe .*xirang train .*gpt2_debug.yaml --set data.train=data/debug/train .*--set train.steps=4 --set metrics.jsonl=dry/points/ranks2/metrics.jsonl$" out.txt ||
      die "point 4's command: $(cat out.txt)"
    [ ! -e dry ] && [ ! -e launches.txt ] || die "--dry-run ran or wrote something"
    echo "ok [$case]: 4 points, 3 commands, 1 refusal, nothing written" ;;
  timeout)
    prepare_data
    cat >hang.yaml <<EOF
base: $src/configs/gpt2_debug.yaml
set: {data.train: data/debug/train, faults.kind: hang, faults.rank: 1, faults.step: 2, comm.timeout_s: 600}
points: [{ranks: 2, train.seed: 4242}]
steps: 4
timeout_s: 6
# The shell stays the parent of mpirun here (it does not exec the last command): only
# killing the whole process group ends mpirun and the ranks.
launcher: "echo launching; mpirun -np {ranks} --oversubscribe {xirang} {args}"
env: {OMP_NUM_THREADS: "1"}
EOF
    rm -rf hang
    "$xirang" sweep hang.yaml --out hang >out.txt 2>err.txt || die "sweep failed: $(cat err.txt)"
    grep -q '"status":"timeout","reason":"no result within timeout_s=6; the process group was killed"' hang/results.jsonl ||
      die "not recorded as a timeout: $(cat hang/results.jsonl)"
    sleep 1
    ! pgrep -f 'hang/points/ranks2-seed4242/metrics.jsonl' >/dev/null || die "processes of the killed point remain: $(pgrep -af hang/points)"
    # The sweep itself stopped (as scancel or Ctrl-C would): its running point goes with it.
    rm -rf hang
    "$xirang" sweep hang.yaml --out hang >out.txt 2>err.txt &
    sweep_pid=$!
    for _ in $(seq 50); do pgrep -f 'hang/points/ranks2-seed4242/metrics.jsonl' >/dev/null && break; sleep 0.2; done
    sleep 1
    kill -TERM $sweep_pid
    wait $sweep_pid
    rc=$?
    [ "$rc" = 143 ] || die "the stopped sweep exited with $rc, expected 143 (SIGTERM)"
    ! pgrep -f 'hang/points/ranks2-seed4242/metrics.jsonl' >/dev/null ||
      die "processes of the stopped sweep's point remain: $(pgrep -af hang/points)"
    echo "ok [$case]: timeout recorded, no process left; a stopped sweep takes its running point along" ;;
  rounds)
    prepare_data
    mkdir -p rounds && cd rounds && ln -sfn ../data data || die "no rounds folder"
    cat >rounds.yaml <<EOF
base: $src/configs/gpt2_debug.yaml
set: {data.train: data/debug/train, model.n_layer: 2}
points: [{ranks: 1}, {ranks: 2, parallel.tp: 3}, {ranks: 1, train.seed: 7}]
steps: 3
warmup: 1
repeats: 2
repeat_order: rounds
launcher: "echo {id} {dir} >>launches.txt; mpirun -np {ranks} --oversubscribe {xirang} {args}"
env: {OMP_NUM_THREADS: "1"}
EOF
    rm -rf out launches.txt
    "$xirang" sweep rounds.yaml --out out >out.txt 2>err.txt || die "sweep failed: $(cat err.txt)"
    want="ranks1 out/points/ranks1/r1
ranks1-seed7 out/points/ranks1-seed7/r1
ranks1 out/points/ranks1/r2
ranks1-seed7 out/points/ranks1-seed7/r2"
    [ "$(cat launches.txt)" = "$want" ] || die "launch order: $(cat launches.txt)"
    grep -qE '^\[1/3\] ranks1: repeat 1 of 2 done \(median [0-9.]+ ms/step\) \| elapsed [0-9:]+, ETA [0-9:]+$' out.txt ||
      die "no progress line for the first round: $(cat out.txt)"
    got=$(jsonl_eval out/results.jsonl "rows.map(r => [r.id, r.status, r.repeats, r.steps_measured || 0].join(':')).join(' ')" \
      "' '.join('%s:%s:%s:%s' % (r['id'], r['status'], r['repeats'], r['steps_measured'] or 0) for r in rows)")
    [ "$got" = "ranks2-tp3:refused:0:0 ranks1:ok:2:4 ranks1-seed7:ok:2:4" ] || die "rows (id:status:repeats:steps): $got"
    echo "ok [$case]: 4 runs in two rounds, the refused point recorded first, 2 repeats pooled per row" ;;
  bad_input)
    write_spec
    printf 'base: %s\nrepeat_order: sideways\n' "$src/configs/gpt2_debug.yaml" >bad10.yaml
    expect_error 1 "repeat_order='sideways' must be points \(each point's repeats in a row\) or rounds" -- sweep bad10.yaml
    printf 'base: %s\nbogus: 1\n' "$src/configs/gpt2_debug.yaml" >bad1.yaml
    expect_error 1 "sweep spec bad1.yaml: unknown key 'bogus' \(line 2\)" -- sweep bad1.yaml
    printf 'base: %s\naxes: {parallel.tp: 2}\n' "$src/configs/gpt2_debug.yaml" >bad2.yaml
    expect_error 1 "axes.parallel.tp must be a non-empty list of values" -- sweep bad2.yaml
    printf 'base: %s\naxes: {parallel.tpx: [1, 2]}\n' "$src/configs/gpt2_debug.yaml" >bad3.yaml
    expect_error 1 "point 1 \(tpx1\): override 'parallel.tpx=1': unknown key 'parallel.tpx'" -- sweep bad3.yaml
    printf 'base: [unclosed\n' >bad4.yaml
    expect_error 1 "sweep spec bad4.yaml: not valid YAML" -- sweep bad4.yaml
    printf 'base: nowhere.yaml\n' >bad5.yaml
    expect_error 1 "base config 'nowhere.yaml' does not exist" -- sweep bad5.yaml
    printf 'base: %s\nsteps: 3\nwarmup: 3\n' "$src/configs/gpt2_debug.yaml" >bad6.yaml
    expect_error 1 "warmup=3 leaves no measured step of steps=3" -- sweep bad6.yaml
    printf 'base: %s\nlauncher: "mpiexec -n {ranks} {xirang}"\n' "$src/configs/gpt2_debug.yaml" >bad7.yaml
    expect_error 1 "is not mpirun, srun or a command template holding \{args\}" -- sweep bad7.yaml
    printf 'base: %s\npoints: [{ranks: 2}, {ranks: 2}]\n' "$src/configs/gpt2_debug.yaml" >bad8.yaml
    expect_error 1 "points 1 and 2 have the same settings \(id ranks2\)" -- sweep bad8.yaml
    printf 'base: %s\npoints: [{train.steps: 5}]\n' "$src/configs/gpt2_debug.yaml" >bad9.yaml
    expect_error 1 "train.steps is set by the sweep" -- sweep bad9.yaml
    expect_error 1 "sweep spec missing.yaml: cannot read the file" -- sweep missing.yaml
    expect_error 2 "sweep: no spec given" -- sweep
    expect_error 2 "sweep: unknown option '--frobnicate'" -- sweep spec.yaml --frobnicate
    expect_error 2 "sweep: --out needs a value" -- sweep spec.yaml --out ;;
  *) die "unknown case $case" ;;
esac
