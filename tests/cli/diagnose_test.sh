#!/usr/bin/env bash
# xirang diagnose on written-out traces (the hang runs themselves are in
# tests/parallel/fault_test.sh): a rank that dumped but never posted the
# collective the others wait in is named with its last operation; a dump
# for a rank not in the world, a damaged file and a directory without
# traces are one error line each.
# Usage: diagnose_test.sh XIRANG SOURCE_DIR WORK_DIR CASE
set -uo pipefail
xirang=$1 src=$2 work=$3 case=$4
mkdir -p "$work"
cd "$work" || exit 1
. "$src/tests/cli/lib.sh"

# trace RANK LAST_SEQ LAST_STATE [KIND [GROUP]]: rank RANK of a GROUP (dp) of 3 whose last
# collective there is KIND (all_reduce) #LAST_SEQ.
trace() {
  local ops='' s kind=${4:-all_reduce} group=${5:-dp}
  for s in $(seq 1 "$2"); do
    local state=done
    [ "$s" = "$2" ] && state=$3
    ops+="${ops:+,}{\"id\": $s, \"channel\": 1, \"kind\": \"$kind\", \"seq\": $s, \"peer\": -1, \"tag\": -1,"
    ops+=" \"bytes\": 4096, \"state\": \"$state\", \"posted_s\": $s.0, \"started_s\": $s.5, \"completed_s\": 0}"
  done
  cat >"t/comm_trace.rank$1.json" <<EOF
{"format": "xirang-comm-trace-1", "rank": $1, "world_size": 3, "time_s": 20.0, "reason": "test",
 "channels": [{"group": "world", "instance": 0, "rank": $1, "world_ranks": [0, 1, 2]},
              {"group": "$group", "instance": 0, "rank": $1, "world_ranks": [0, 1, 2]}],
 "ops": [$ops]}
EOF
}

case $case in
  behind_with_trace)
    rm -rf t && mkdir t
    trace 0 4 in_flight; trace 1 4 in_flight; trace 2 3 done
    "$xirang" diagnose t >out.txt 2>err.txt || die "diagnose failed: $(cat err.txt)"
    grep -q "^traces: 3 of 3 ranks (0 1 2)$" out.txt || die "wrong traces line: $(cat out.txt)"
    grep -q "^dp (world ranks 0 1 2): ranks 0 1 wait in all_reduce #4 (4096 bytes, 15.5 s); rank 2 never posted it; rank 2's last is all_reduce #3 (done)$" out.txt ||
      die "wrong finding: $(cat out.txt)"
    grep -q "^summary: rank 2 is behind: ranks 0 1 wait for it in dp all_reduce #4; its own trace shows where it stopped$" out.txt ||
      die "wrong summary: $(cat out.txt)"
    echo "ok [$case]: $(tail -n 1 out.txt)" ;;
  ep_all_to_all)
    # Expert parallelism's exchange is a collective of its ep group like any other.
    rm -rf t && mkdir t
    trace 0 4 in_flight all_to_all_v ep; trace 1 3 done all_to_all_v ep; trace 2 4 in_flight all_to_all_v ep
    "$xirang" diagnose t >out.txt 2>err.txt || die "diagnose failed: $(cat err.txt)"
    grep -q "^ep (world ranks 0 1 2): ranks 0 2 wait in all_to_all_v #4 (4096 bytes, 15.5 s); rank 1 never posted it; rank 1's last is all_to_all_v #3 (done)$" out.txt ||
      die "wrong finding: $(cat out.txt)"
    grep -q "^summary: rank 1 is behind: ranks 0 2 wait for it in ep all_to_all_v #4" out.txt ||
      die "wrong summary: $(cat out.txt)"
    echo "ok [$case]: $(tail -n 1 out.txt)" ;;
  all_posted)
    # Every rank waits in the same collective: nobody is behind.
    rm -rf t && mkdir t
    trace 0 4 in_flight; trace 1 4 in_flight; trace 2 4 in_flight
    "$xirang" diagnose t >out.txt 2>err.txt || die "diagnose failed: $(cat err.txt)"
    grep -q "every rank posted it and none completed it" out.txt || die "wrong finding: $(cat out.txt)"
    grep -q "^summary: no rank is behind" out.txt || die "wrong summary: $(cat out.txt)"
    echo "ok [$case]" ;;
  no_traces) rm -rf e && mkdir e; expect_error 1 "data error: diagnose: no comm_trace.rank<N>.json in e" -- diagnose e ;;
  not_a_directory) expect_error 2 "usage error: diagnose: 'nothing_here' is not a directory" -- diagnose nothing_here ;;
  damaged)
    rm -rf t && mkdir t
    trace 0 2 in_flight
    head -c 100 t/comm_trace.rank0.json >t/comm_trace.rank1.json
    expect_error 1 "data error: diagnose: .*comm_trace.rank1.json is not a comm trace" -- diagnose t ;;
  *) die "unknown case '$case'" ;;
esac
