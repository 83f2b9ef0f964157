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
# ab_variants FN: runs FN "" "" (the default build), then FN -abN DEFINES for each ';'-separated
# entry of AB_DEFINES (each a KVSTREAM_NVRTC_DEFINES value, e.g. "FA_PIPE=1;FA_KBUF1=1"), naming
# each variant in $S first.
ab_variants() {
  local fn=$1 ab=0 v
  "$fn" "" ""
  IFS=';' read -r -a variants <<<"${AB_DEFINES:-}"
  for v in "${variants[@]}"; do
    [ -n "$v" ] || continue
    ab=$((ab + 1))
    echo "variant -ab$ab: $v" | tee -a "$S"
    "$fn" "-ab$ab" "$v"
  done
}
