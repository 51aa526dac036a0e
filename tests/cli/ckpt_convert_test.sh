#!/usr/bin/env bash
# `xirang ckpt convert` and `xirang eval` from the command line, on a
# checkpoint of the debug model trained to step 4:
#   hf_roundtrip_eval     exported to safetensors and imported back, it evaluates to the identical val_loss
#   reshard_resume_tp2    converted to tp=2, it resumes under mpirun -np 2 and matches the one-rank continuation
#   import_resumes_fresh  an imported (parameters-only) checkpoint trains, its optimizer state starting fresh
#   bad_input             one error line and a non-zero exit for each bad input; the source is never touched
#   llama_hf_roundtrip_eval  a llama_debug checkpoint (step 4) exported as LlamaForCausalLM safetensors and
#                         imported back evaluates to the identical val_loss; imported at tp=2 it evaluates
#                         under mpirun -np 2 to the same val_loss (1e-5) and trains; a GPT-2 config is refused
#   qwen3_hf_roundtrip_eval  the same for qwen3_debug as Qwen3ForCausalLM (q/k norm weights, head_dim 16)
# Usage: ckpt_convert_test.sh XIRANG_BINARY SOURCE_DIR WORK_DIR CASE
set -uo pipefail
xirang=$1 src=$2 work=$3 case=$4
mkdir -p "$work"
cd "$work" || exit 1

. "$src/tests/cli/lib.sh"


cfg=$src/configs/gpt2_debug.yaml
data=(--set data.train=data/debug/train --set data.val=data/debug/val --set metrics.peak_tflops=1)
prepare_data() {
  [ -f data/debug/train/index.json ] ||
    "$xirang" data prepare --tokenizer bytes --out data/debug --force "$src/tests/assets/text/english.txt" \
      >/dev/null || die "data prepare failed"
}
# The shared checkpoint: the schedule of 6 steps, stopped after 4 (ck/step_00000004).
prepare() {
  prepare_data
  [ -f ck/step_00000004/meta.json ] && [ ck/step_00000004/meta.json -nt "$xirang" ] && return
  rm -rf ck
  "$xirang" train "$cfg" "${data[@]}" --set train.steps=6 --set train.stop_after=4 --set checkpoint.dir=ck \
    --set checkpoint.every=2 >/dev/null 2>train.err || die "training failed: $(tail -3 train.err)"
}

# loss_of FILE STEP: the loss a metrics file logged for STEP.
loss_of() { grep "\"step\":$2," "$1" | sed 's/.*"loss":\([^,]*\),.*/\1/'; }

mpi=(env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -np 2 --oversubscribe)

# family_roundtrip ARCH CONFIG HF_CLASS TENSORS KV_ROWS FIELD: a checkpoint of a LLaMA-family
# debug config (step 4) exported as HF_CLASS safetensors (TENSORS tensors,
# k_proj KV_ROWS x 64, FIELD in config.json), imported back: the identical
# val_loss; imported at tp=2: the same val_loss (1e-5) under mpirun -np 2,
# and it trains; a GPT-2 config is refused.
family_roundtrip() {
  local arch=$1 fcfg=$2 hf_class=$3 tensors=$4 kv_rows=$5 field=$6
  prepare_data
  rm -rf "ck_$arch" "hf_$arch" "${arch}_back" "${arch}_tp2"
  "$xirang" train "$fcfg" "${data[@]}" --set train.steps=6 --set train.stop_after=4 --set checkpoint.dir=ck_$arch \
    --set checkpoint.every=4 >/dev/null 2>train.err || die "$arch training failed: $(tail -3 train.err)"
  "$xirang" ckpt convert ck_$arch hf_$arch/model.safetensors >out.txt 2>err.txt || die "export failed: $(cat err.txt)"
  grep -q "wrote .*hf_$arch/model.safetensors ($tensors tensors" out.txt || die "unexpected summary: $(cat out.txt)"
  grep -q "\"model_type\": \"$arch\"" hf_$arch/config.json || die "config.json: $(cat hf_$arch/config.json)"
  grep -q "$field" hf_$arch/config.json || die "no $field: $(cat hf_$arch/config.json)"
  head -c 20000 hf_$arch/model.safetensors | grep -q '"model.layers.7.self_attn.k_proj.weight":{"data_offsets":\[[0-9]*,[0-9]*\],"dtype":"F32","shape":\['"$kv_rows"',64\]}' ||
    die "no k_proj of ($kv_rows, 64) in the header"
  "$xirang" ckpt convert hf_$arch/model.safetensors ${arch}_back --config "$fcfg" >/dev/null 2>err.txt ||
    die "import failed: $(cat err.txt)"
  "$xirang" eval "$fcfg" "${data[@]}" --checkpoint ck_$arch >a.txt 2>a.err || die "eval of ck_$arch failed: $(cat a.err)"
  "$xirang" eval "$fcfg" "${data[@]}" --checkpoint ${arch}_back >b.txt 2>b.err || die "eval of the import failed: $(cat b.err)"
  grep -qE '^val_loss [0-9]+\.[0-9]{12,}$' a.txt || die "unexpected eval output: $(cat a.txt)"
  cmp -s a.txt b.txt || die "val_loss differs: $(cat a.txt) vs $(cat b.txt)"
  "$xirang" ckpt convert hf_$arch/model.safetensors ${arch}_tp2 --config "$fcfg" --layout tp=2 >/dev/null 2>err.txt ||
    die "import at tp=2 failed: $(cat err.txt)"
  "${mpi[@]}" "$xirang" eval "$fcfg" "${data[@]}" --set parallel.tp=2 --checkpoint ${arch}_tp2 >c.txt 2>c.err ||
    die "eval at tp=2 failed: $(tail -3 c.err)"
  awk -v a="$(cut -d' ' -f2 a.txt)" -v c="$(cut -d' ' -f2 c.txt)" \
    'BEGIN { d = a - c; exit !(a > 0 && (d < 0 ? -d : d) < 1e-5) }' || die "val_loss at tp=2 $(cat c.txt), $(cat a.txt) on one rank"
  # The tp=2 import trains under mpirun -np 2, its optimizer state starting fresh.
  "${mpi[@]}" "$xirang" train "$fcfg" "${data[@]}" --set parallel.tp=2 --set train.steps=1 --set checkpoint.dir=${arch}_tp2 \
    >out.txt 2>err.txt || die "training from the tp=2 import failed: $(tail -3 err.txt)"
  grep -q "resumed from .*step_00000000 at step 0" err.txt || die "did not resume at step 0: $(head -5 err.txt)"
  grep -q "trained to step 1 of 1" out.txt || die "did not train: $(cat out.txt)"
  expect_error 1 "data error: .*hf_$arch/config.json': architectures is \[\"$hf_class\"\], a model other than the config's: model.arch=gpt2" -- \
    ckpt convert hf_$arch/model.safetensors out_dir --config "$cfg"
  echo "ok [$case]: $(cat a.txt) for the $arch checkpoint and its safetensors round trip; tp=2 $(cat c.txt)"
}

case $case in
  hf_roundtrip_eval)
    prepare
    rm -rf hf imported
    "$xirang" ckpt convert ck hf/model.safetensors >out.txt 2>err.txt || die "export failed: $(cat err.txt)"
    grep -q "wrote .*hf/model.safetensors" out.txt || die "no summary: $(cat out.txt)"
    [ -f hf/config.json ] || die "no config.json next to the export"
    grep -q '"model_type": "gpt2"' hf/config.json || die "config.json: $(cat hf/config.json)"
    "$xirang" ckpt convert hf/model.safetensors imported --config "$cfg" >out.txt 2>err.txt ||
      die "import failed: $(cat err.txt)"
    "$xirang" ckpt inspect imported >insp.txt 2>&1 || die "the import does not verify: $(tail -3 insp.txt)"
    grep -q "step 0, saved from dp 1 x tp 1 x pp 1" insp.txt || die "unexpected import: $(head -2 insp.txt)"
    ! grep -q "adam_m" insp.txt || die "an import holds optimizer state"
    "$xirang" eval "$cfg" "${data[@]}" --checkpoint ck >a.txt 2>a.err || die "eval of ck failed: $(cat a.err)"
    "$xirang" eval "$cfg" "${data[@]}" --checkpoint imported/step_00000000 >b.txt 2>b.err ||
      die "eval of the import failed: $(cat b.err)"
    grep -qE '^val_loss [0-9]+\.[0-9]{12,}$' a.txt || die "unexpected eval output: $(cat a.txt)"
    cmp -s a.txt b.txt || die "val_loss differs: $(cat a.txt) vs $(cat b.txt)"
    [ "$(ls ck)" = "$(printf 'latest\nstep_00000002\nstep_00000004')" ] || die "eval wrote into ck: $(ls ck)"
    # bf16 storage changes the parameters, and so the loss (a check that eval reads the checkpoint at all).
    rm -rf ck_bf16
    "$xirang" ckpt convert ck ck_bf16 --dtype bf16 --params-only >/dev/null 2>err.txt || die "bf16 failed: $(cat err.txt)"
    "$xirang" eval "$cfg" "${data[@]}" --checkpoint ck_bf16 >c.txt 2>c.err || die "eval of bf16 failed: $(cat c.err)"
    ! cmp -s a.txt c.txt || die "the bf16 checkpoint evaluates identically: $(cat c.txt)"
    echo "ok [$case]: $(cat a.txt) for the checkpoint and its safetensors round trip; bf16 $(cat c.txt)" ;;
  reshard_resume_tp2)
    prepare
    rm -rf ck_one ck_tp2 one.jsonl tp2.jsonl
    cp -r ck ck_one
    "$xirang" train "$cfg" "${data[@]}" --set train.steps=6 --set checkpoint.dir=ck_one --set metrics.jsonl=one.jsonl \
      >/dev/null 2>err.txt || die "the one-rank continuation failed: $(tail -3 err.txt)"
    "$xirang" ckpt convert ck ck_tp2 --layout tp=2,zero=1 >out.txt 2>err.txt || die "reshard failed: $(cat err.txt)"
    grep -q "dp 1 x tp 2 x pp 1 (ZeRO-1)" out.txt || die "unexpected summary: $(cat out.txt)"
    "${mpi[@]}" "$xirang" train "$cfg" "${data[@]}" --set parallel.tp=2 --set train.steps=6 --set checkpoint.dir=ck_tp2 \
      --set metrics.jsonl=tp2.jsonl >out.txt 2>err.txt || die "the tp=2 resume failed: $(tail -5 err.txt)"
    grep -q "resumed from .*step_00000004 at step 4" err.txt || die "did not resume at step 4: $(head -5 err.txt)"
    [ "$(wc -l <tp2.jsonl)" = 2 ] || die "the resumed run logged $(wc -l <tp2.jsonl) steps, expected 2"
    for s in 5 6; do
      a=$(loss_of one.jsonl $s) b=$(loss_of tp2.jsonl $s)
      awk -v a="$a" -v b="$b" 'BEGIN { d = a - b; exit !(a > 0 && (d < 0 ? -d : d) < 1e-5) }' ||
        die "step $s: loss $b at tp=2, $a on one rank"
    done
    echo "ok [$case]: steps 5-6 at tp=2 match one rank ($(loss_of tp2.jsonl 6) vs $(loss_of one.jsonl 6))" ;;
  import_resumes_fresh)
    prepare
    rm -rf hf2 imp
    "$xirang" ckpt convert ck hf2/model.safetensors >/dev/null 2>err.txt || die "export failed: $(cat err.txt)"
    "$xirang" ckpt convert hf2/model.safetensors imp --config "$cfg" --layout dp=2 >/dev/null 2>err.txt ||
      die "import failed: $(cat err.txt)"
    "$xirang" train "$cfg" "${data[@]}" --set train.steps=2 --set checkpoint.dir=imp >out.txt 2>err.txt ||
      die "training from the import failed: $(tail -3 err.txt)"
    grep -q "has no optimizer state (parameters only): AdamW starts fresh at step 0" err.txt ||
      die "no fresh-optimizer line: $(head -5 err.txt)"
    grep -q "resumed from .*step_00000000 at step 0" err.txt || die "did not resume at step 0: $(head -5 err.txt)"
    grep -q "trained to step 2 of 2" out.txt || die "did not train: $(cat out.txt)"
    [ -f imp/step_00000002/meta.json ] || die "no checkpoint at step 2"
    echo "ok [$case]" ;;
  bad_input)
    prepare
    rm -rf out_dir taken hf3 bare
    before=$(find ck -type f -exec md5sum {} + | sort)
    printf 'just some text\n' >notes.txt
    expect_error 1 "data error: .*notes\.txt.*unknown format" -- ckpt convert notes.txt out_dir --config "$cfg"
    printf 'XXXXYYYY and more bytes' >bad.bin
    expect_error 1 "data error: .*bad\.bin.*not an llm.c model file: magic number" -- \
      ckpt convert bad.bin out_dir --config "$cfg"
    "$xirang" ckpt convert ck hf3/model.safetensors >/dev/null 2>err.txt || die "export failed: $(cat err.txt)"
    head -c 5000 hf3/model.safetensors >cut.safetensors
    expect_error 1 "data error: .*cut\.safetensors.*truncated" -- ckpt convert cut.safetensors out_dir --config "$cfg"
    expect_error 1 "data error: .*hf3/config.json': n_embd is 64 but the config has model.d_model=128" -- \
      ckpt convert hf3/model.safetensors out_dir --config "$src/configs/gpt2_demo.yaml"
    mkdir -p bare && cp hf3/model.safetensors bare/
    expect_error 1 "data error: .*bare/model.safetensors': tensor 'transformer.h.4.* is no parameter of the GPT-2 .*d_model=128" -- \
      ckpt convert bare/model.safetensors out_dir --config "$src/configs/gpt2_demo.yaml"
    expect_error 2 "usage error: .*needs --config" -- ckpt convert hf3/model.safetensors out_dir
    expect_error 2 "usage error: .*--layout.*unknown key 'tpp'" -- ckpt convert ck out_dir --layout tpp=2
    expect_error 1 "config error: .*model.n_head=4 is not divisible by parallel.tp=3" -- ckpt convert ck out_dir --layout tp=3
    mkdir -p taken/step_00000001
    expect_error 1 "data error: .*taken.*already exists" -- ckpt convert ck taken
    expect_error 1 "data error: .*is the source" -- ckpt convert ck ck --force
    expect_error 1 "data error: .*already exists" -- ckpt convert ck hf3/model.safetensors
    expect_error 1 "checkpoint error: .*no complete checkpoint" -- eval "$cfg" "${data[@]}" --checkpoint taken
    [ ! -e out_dir ] && [ ! -e out_dir.converting ] || die "a failed conversion left out_dir behind"
    [ "$(find ck -type f -exec md5sum {} + | sort)" = "$before" ] || die "the source checkpoint changed"
    "$xirang" ckpt convert ck taken --force >/dev/null 2>err.txt || die "--force did not replace: $(cat err.txt)"
    [ -f taken/step_00000004/meta.json ] && [ ! -e taken/step_00000001 ] || die "--force did not replace taken/"
    echo "ok [$case]" ;;
  llama_hf_roundtrip_eval)
    family_roundtrip llama "$src/configs/llama_debug.yaml" LlamaForCausalLM 75 32 '"rope_type": "llama3"' ;;
  qwen3_hf_roundtrip_eval)
    family_roundtrip qwen3 "$src/configs/qwen3_debug.yaml" Qwen3ForCausalLM 90 64 '"head_dim": 16' ;;
  *) die "unknown case" ;;
esac
