# Sourced by the device-session scripts (scripts/gpu-session.sh, scripts/gpu-attn-profile.sh).
# step NAME TIMEOUT CMD...: runs CMD under TIMEOUT seconds with its output in $OUT/NAME.log and
# appends "NAME rc=RC Ns total (Ms)" to $S (and stdout), so one slow step cannot eat the call.
step() {
  local name=$1 t=$2
  shift 2
  local t0=$SECONDS
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc ${SECONDS}s total ($((SECONDS - t0))s)" | tee -a "$S"
}
