#!/usr/bin/env bash
# The Prometheus endpoint (metrics.prometheus) against a real Prometheus.
#   scrape       a Prometheus server (Debian's package) scrapes a training
#                run every second; its HTTP API then has the run's series
#                with the job's labels; `promtool check metrics` accepts a
#                /metrics text taken during the run; `promtool check rules`
#                accepts configs/prometheus/xirang_rules.yml; the rules and
#                configs/grafana/xirang.json query only served metrics
#   per_rank     two ranks under mpirun with metrics.prometheus_per_rank:
#                each serves its own values at PORT + its local rank
#   port_in_use  a taken port is one config error line naming the key and
#                the address
# Everything listens on and talks to 127.0.0.1 only. Every process the test
# starts is stopped on exit, also on failure.
# Usage: prometheus_test.sh XIRANG_BINARY SOURCE_DIR WORK_DIR CASE
# Exit 77 (ctest: skipped) when prometheus, promtool or curl is not installed.
set -uo pipefail
xirang=$1 src=$2 work=$3/$4 case=$4
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1

. "$src/tests/cli/lib.sh"
skip() { echo "SKIP [$case]: $*"; exit 77; }

for tool in prometheus promtool curl; do
  command -v "$tool" >/dev/null || skip "$tool is not installed (tools/setup.sh installs the prometheus package)"
done
[ "$case" != per_rank ] || command -v mpirun >/dev/null || skip "mpirun is not installed"

pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
}
trap cleanup EXIT

# free_port [N]: a loopback port with nothing listening on it nor on the N-1 after it.
free_port() {
  local n=${1:-1} p i taken
  for _ in $(seq 100); do
    p=$((20000 + RANDOM % 40000)) taken=
    for ((i = 0; i < n; i++)); do
      (exec 3<>"/dev/tcp/127.0.0.1/$((p + i))") 2>/dev/null && taken=1
    done
    [ -z "$taken" ] && { echo "$p"; return; }
  done
  die "no free loopback port"
}

# wait_for URL PATTERN SECONDS [PID]: polls URL until its body matches PATTERN
# (the body is in body.txt); gives up early when process PID has ended.
wait_for() {
  local url=$1 pattern=$2 deadline=$((SECONDS + $3)) pid=${4:-}
  while [ $SECONDS -lt $deadline ]; do
    curl -sf --max-time 2 "$url" >body.txt 2>/dev/null && grep -qE "$pattern" body.txt && return 0
    [ -z "$pid" ] || kill -0 "$pid" 2>/dev/null || return 1
    sleep 0.2
  done
  return 1
}

# start_prometheus PORT TARGET: a Prometheus on 127.0.0.1:PORT scraping TARGET every second.
start_prometheus() {
  cat >prometheus.yml <<EOF
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: xirang_test
    honor_labels: true  # keep the exporter's job label (metrics.job)
    static_configs:
      - targets: ['$2']
EOF
  prometheus --config.file=prometheus.yml --storage.tsdb.path=tsdb --web.listen-address="127.0.0.1:$1" \
    >prometheus.log 2>&1 &
  pids+=($!)
  wait_for "http://127.0.0.1:$1/-/ready" . 30 || die "prometheus did not become ready: $(tail -n 5 prometheus.log)"
  # Target discovery reaches the scrape loop up to 5 s after start: wait for it, so the run gets scraped.
  wait_for "http://127.0.0.1:$1/api/v1/targets" '"scrapeUrl":"http://'"$2"'/metrics"' 30 ||
    die "prometheus has no target $2: $(cat body.txt)"
}

# query PROMQL: the value of the first series of an instant query (empty when none).
query() {
  curl -sf --max-time 5 -G "http://127.0.0.1:$pport/api/v1/query" --data-urlencode "query=$1" >q.json ||
    die "query '$1' failed"
  sed -n 's/.*"value":\[[0-9.]*,"\([^"]*\)"\].*/\1/p' q.json
}

# The training's error line, else the end of its stderr.
train_error() { grep -m 1 '^xirang: ' train.err || tail -n 3 train.err; }

prepare_data() {
  "$xirang" data prepare --tokenizer bytes --out data --force "$src/tests/assets/text/english.txt" >/dev/null ||
    die "data prepare failed"
}

cfg=$src/configs/gpt2_debug.yaml
# 80 steps of about 100 ms (every sample read waits 12.5 ms; prefetching hides part of it): 5 s or more of scrapes.
train_args=(train "$cfg" --set data.train=data/train --set train.steps=80 --set data.read_delay_ms=12.5
            --set metrics.job=prom_test)

case $case in
  scrape)
    prepare_data
    xport=$(free_port) pport=$(free_port)
    start_prometheus "$pport" "127.0.0.1:$xport"
    "$xirang" "${train_args[@]}" --set metrics.prometheus="127.0.0.1:$xport" \
      --set checkpoint.dir=ck --set checkpoint.every=20 >train.out 2>train.err &
    train_pid=$!
    pids+=("$train_pid")
    wait_for "http://127.0.0.1:$xport/metrics" '^xirang_steps_total\{[^}]*\} [1-9]' 30 "$train_pid" ||
      die "no step on the endpoint: $(train_error)"
    cp body.txt scraped.txt
    promtool check metrics <scraped.txt >promtool.txt 2>&1 || die "promtool check metrics: $(cat promtool.txt)"
    grep -q '^xirang_step_seconds{job="prom_test",rank="0"} 0\.' scraped.txt ||
      die "no step time in seconds: $(grep '^xirang_step_seconds' scraped.txt)"
    wait "$train_pid" || die "train failed: $(cat train.err)"
    sleep 1.5  # the scrape in flight lands
    # Range selections: after the run has gone, its series end in staleness markers.
    sel='{job="prom_test",rank="0"}'
    scrapes=$(query "count_over_time(xirang_steps_total$sel[5m])")
    [ -n "$scrapes" ] && [ "$scrapes" -ge 2 ] || die "expected 2 or more scrapes of the run, got '$scrapes': $(cat q.json)"
    steps=$(query "max_over_time(xirang_steps_total$sel[5m])")
    [ -n "$steps" ] && [ "$steps" -ge 1 ] && [ "$steps" -le 80 ] || die "xirang_steps_total: '$steps': $(cat q.json)"
    tokens=$(query "max_over_time(xirang_tokens_total$sel[5m])")
    # gpt2_debug: global_batch 8 x seq_len 64 = 512 tokens a step.
    [ "$tokens" = "$((steps * 512))" ] || die "xirang_tokens_total $tokens after $steps steps, expected $((steps * 512))"
    # Both counters' maxima come from the last scrape: a checkpoint every 20 steps.
    ckpts=$(query "max_over_time(xirang_checkpoints_total$sel[5m])")
    [ "$ckpts" = "$((steps / 20))" ] || die "xirang_checkpoints_total $ckpts after $steps steps, expected $((steps / 20))"
    tps=$(query "max_over_time(xirang_tokens_per_second$sel[5m])")
    awk -v v="$tps" 'BEGIN { exit !(v > 0) }' || die "xirang_tokens_per_second: '$tps'"
    st=$(query "max_over_time(xirang_step_seconds$sel[5m])")
    awk -v v="$st" 'BEGIN { exit !(v > 0.005 && v < 5) }' || die "xirang_step_seconds '$st' is not in seconds"
    loss=$(query "min_over_time(xirang_loss$sel[5m])")
    awk -v v="$loss" 'BEGIN { exit !(v > 0 && v < 10) }' || die "xirang_loss: '$loss'"
    promtool check rules "$src/configs/prometheus/xirang_rules.yml" >rules.txt 2>&1 ||
      die "promtool check rules: $(cat rules.txt)"
    # The shipped rules and dashboard query only metrics the endpoint serves.
    dashboard=$src/configs/grafana/xirang.json
    if command -v python3 >/dev/null; then
      python3 -m json.tool "$dashboard" >/dev/null 2>json.txt || die "$dashboard is not JSON: $(cat json.txt)"
    fi
    for name in $(grep -hE '^ *(expr:|"expr":)' "$src/configs/prometheus/xirang_rules.yml" "$dashboard" |
                  grep -oE 'xirang_[a-z_]+' | sort -u); do
      grep -q "^# TYPE $name " scraped.txt || die "$name (in the shipped rules or dashboard) is not served"
    done
    echo "ok [$case]: $scrapes scrapes; $steps steps, $tokens tokens, $ckpts checkpoints, max $tps tokens/s" ;;
  per_rank)
    prepare_data
    xport=$(free_port 2)
    mpirun -np 2 "$xirang" "${train_args[@]}" --set metrics.prometheus="127.0.0.1:$xport" \
      --set metrics.prometheus_per_rank=true >train.out 2>train.err &
    train_pid=$!
    pids+=("$train_pid")
    for r in 0 1; do
      wait_for "http://127.0.0.1:$((xport + r))/metrics" "^xirang_steps_total\{job=\"prom_test\",rank=\"$r\"\} [1-9]" 60 "$train_pid" ||
        die "rank $r does not serve its steps on port $((xport + r)): $(train_error)"
      promtool check metrics <body.txt >promtool.txt 2>&1 || die "promtool check metrics (rank $r): $(cat promtool.txt)"
    done
    wait "$train_pid" || die "train failed: $(cat train.err)"
    echo "ok [$case]: ranks 0 and 1 on ports $xport and $((xport + 1))" ;;
  port_in_use)
    prepare_data
    pport=$(free_port)
    start_prometheus "$pport" "127.0.0.1:$pport"
    # The memory plan comes first; then the run stops with one error line, before any step.
    "$xirang" "${train_args[@]}" --set metrics.prometheus="127.0.0.1:$pport" >out.txt 2>err.txt
    rc=$?
    [ "$rc" = 1 ] || die "exit code $rc, expected 1 (stderr: $(cat err.txt))"
    [ "$(grep -c '^xirang: ' err.txt)" = 1 ] || die "expected one error line, got: $(cat err.txt)"
    ! grep -q '^step ' err.txt || die "a step ran before the error: $(cat err.txt)"
    want="^xirang: config error: metrics\.prometheus: cannot listen on 127\.0\.0\.1:$pport \(Address already in use\)$"
    tail -n 1 err.txt | grep -qE "$want" || die "the last line does not match /$want/: $(tail -n 1 err.txt)"
    echo "ok [$case]: $(tail -n 1 err.txt)" ;;
  *) die "unknown case" ;;
esac
