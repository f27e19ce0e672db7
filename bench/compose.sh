#!/usr/bin/env bash
# bench/compose.sh: the seed program and the digits MLP on the docker-compose cluster against
# the same programs on Client::local(8), in one run, alternating, medians of RUNS each.
#
#   bash bench/compose.sh BUILD_DIR [RUNS]        # as root, from the repository root; RUNS=3
#
# Starts a private dockerd as tests/deploy/compose_test.sh does (deploy/engine.sh), builds the
# image (cached), brings the cluster up as project tessera-bench, measures, takes it down and
# stops the dockerd. Prints for each program the wall time in a client container (which
# includes starting one: printed alone too) and on Client::local(8), and for the MLP its own
# mean step time on both, with the ratio compose / local.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$1/bin
runs=${2:-3}
digits=$PWD/.cache/digits.csv
project=tessera-bench
source deploy/engine.sh
why=$(engine_missing)
[ -z "$why" ] || { echo "bench/compose.sh: $why" >&2; exit 1; }
[ -s "$digits" ] || { echo "bench/compose.sh: no $digits (./dev test fetches it)" >&2; exit 1; }
run=$(mktemp -d /tmp/tessera-compose-bench.XXXXXX)
compose=(docker-compose -p "$project" -f deploy/docker-compose.yml)
export TESSERA_PUBLISH_PORT=0
cleanup() {
  if [ -n "$ENGINE_PID" ]; then
    timeout 120 "${compose[@]}" down -v --timeout 5 >/dev/null 2>&1 || true
    engine_stop
  fi
  rm -rf --one-file-system "$run"
}
trap cleanup EXIT
engine_start "$run" test || exit 1
start=$SECONDS
engine_build "$PWD" runtime tessera:latest >"$run/build.log" 2>&1 || { tail -n 40 "$run/build.log"; exit 1; }
echo "image build: $((SECONDS - start)) s; image: $(($("$DOCKER" image inspect -f '{{.Size}}' tessera:latest) / 1000000)) MB"
start=$SECONDS
timeout 180 "${compose[@]}" up -d --no-build >"$run/up.log" 2>&1 || { cat "$run/up.log"; exit 1; }
engine_wait_healthy "$project" 9 120
echo "up -> 9 healthy: $((SECONDS - start)) s"

ms_since() { echo $((($(date +%s%N) - $1) / 1000000)); }
median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
in_container() {
  "$DOCKER" run --rm --network "${project}_default" -e TESSERA_COORDINATOR=coordinator:5000 \
    -v "$digits:/data/digits.csv:ro" tessera:latest "$@" 2>/dev/null
}
: >"$run/times"
for ((i = 0; i < runs; ++i)); do
  t=$(date +%s%N); in_container /bin/sh -c true; echo "start $(ms_since "$t")" >>"$run/times"
  t=$(date +%s%N); in_container example_seed_layer >/dev/null; echo "seed_compose $(ms_since "$t")" >>"$run/times"
  t=$(date +%s%N); "$bin/example_seed_layer" >/dev/null; echo "seed_local $(ms_since "$t")" >>"$run/times"
  t=$(date +%s%N); out=$(in_container example_mlp_train --data=/data/digits.csv)
  echo "mlp_compose $(ms_since "$t")" >>"$run/times"
  echo "step_compose $(sed -n 's/^mean step time: \([0-9.]*\) ms.*/\1/p' <<<"$out")" >>"$run/times"
  t=$(date +%s%N); out=$("$bin/example_mlp_train" --data="$digits")
  echo "mlp_local $(ms_since "$t")" >>"$run/times"
  echo "step_local $(sed -n 's/^mean step time: \([0-9.]*\) ms.*/\1/p' <<<"$out")" >>"$run/times"
done
m() { awk -v k="$1" '$1 == k { print $2 }' "$run/times" | median; }
printf 'medians of %d runs (load %s)\n' "$runs" "$(cut -d' ' -f1-3 /proc/loadavg)"
printf '  a client container alone (start, /bin/sh -c true, end): %s ms\n' "$(m start)"
printf '  example_seed_layer: compose %s ms (container included), Client::local(8) %s ms\n' "$(m seed_compose)" "$(m seed_local)"
printf '  example_mlp_train:  compose %s ms, Client::local(8) %s ms; ratio %s\n' "$(m mlp_compose)" "$(m mlp_local)" \
  "$(awk -v a="$(m mlp_compose)" -v b="$(m mlp_local)" 'BEGIN { printf "%.2f", a / b }')"
printf '  MLP mean step time: compose %s ms, Client::local(8) %s ms; ratio %s\n' "$(m step_compose)" "$(m step_local)" \
  "$(awk -v a="$(m step_compose)" -v b="$(m step_local)" 'BEGIN { printf "%.2f", a / b }')"
