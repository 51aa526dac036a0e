# tests/cli/lib.sh: what the command-line test scripts share. Source it after
# setting $xirang (the binary) and $case (the ctest case, for messages).

die() { echo "FAIL [$case]: $*"; exit 1; }

# expect_error EXIT_CODE PATTERN -- ARGS...: running xirang with ARGS exits
# with EXIT_CODE and writes exactly one stderr line, "xirang: ..." matching
# PATTERN (stdin is the caller's; redirect it for commands that read it).
expect_error() {
  local want_rc=$1 pattern=$2; shift 3
  "$xirang" "$@" >out.txt 2>err.txt
  local rc=$?
  [ "$rc" = "$want_rc" ] || die "exit code $rc, expected $want_rc for: $* (stderr: $(cat err.txt))"
  [ "$(wc -l <err.txt)" = 1 ] || die "expected one error line, got: $(cat err.txt)"
  grep -q '^xirang: ' err.txt || die "error line does not start with 'xirang: ': $(cat err.txt)"
  grep -qE "$pattern" err.txt || die "error line does not match /$pattern/: $(cat err.txt)"
  echo "ok [$case]: $(cat err.txt)"
}

# json_eval FILE JS_EXPR PY_EXPR: prints the expression evaluated on the JSON
# object `j` in FILE, with node (tools/setup.sh installs it) or python3.
json_eval() {
  if command -v node >/dev/null; then
    node -e "const j = JSON.parse(require('fs').readFileSync('$1', 'utf8')); console.log($2)"
  elif command -v python3 >/dev/null; then
    python3 -c "import json; j = json.load(open('$1')); print($3)"
  else
    echo "SKIP [$case]: neither node nor python3"; exit 77
  fi
}
