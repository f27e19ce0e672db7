#!/usr/bin/env bash
# The docker-compose deployment for real (deploy/): on a private dockerd of its own,
#   1. makes the base image without a registry (debootstrap, once; deploy/engine.sh) and builds
#      the image from the tree through .dockerignore (cached layers, ccache in a cache mount);
#      the runtime image is at most 200 MB and runs as an unprivileged user;
#   2. `docker-compose up` of the coordinator and 8 workers; all nine healthy within 120 s; the
#      coordinator published on 127.0.0.1 only, and `tessera status` from the host through it
#      (with the admin token and CA the `credentials` service made, copied out) sees 8 alive
#      devices, while without a token it is refused;
#   3. from client containers on the compose network: the seed program prints its three lines
#      (and checks every value against the host, exit status), and the digits MLP trains to a
#      test accuracy of at least 0.95;
#   4. a client holding arrays and a compiled program; one worker's process killed: the next
#      call fails naming that device; the container restarts, the worker registers again and
#      the cluster serves the client again (new arrays: the old ones had a shard there);
#   5. `docker-compose down -v`: nothing of the project is left.
# Prints "[ timing ]" lines (image build, up -> healthy, the programs' run times).
#
#   bash tests/deploy/compose_test.sh SOURCE_DIR BUILD_DIR
#
# Skipped (exit 77, saying why) when the machine cannot run it: not root, docker.io,
# docker-compose or debootstrap missing (./dev installs them), no .cache/digits.csv (./dev
# fetches it), or another Tessera engine using the data root ($TESSERA_CACHE/docker).
# Every wait has a deadline; teardown removes only this project's containers and network,
# and stops only the dockerd it started, by pid.
set -euo pipefail
src=$(cd "$1" && pwd)
bin=$2/bin
digits=$src/.cache/digits.csv
project=tessera-test
# shellcheck source=../../deploy/engine.sh
source "$src/deploy/engine.sh"

skip() { echo "SKIP: $*"; exit 77; }
fail() {
  echo "FAIL: $*"
  if [ -n "${ENGINE_PID:-}" ] && [ -n "${compose_up:-}" ]; then   # what the daemons said last
    timeout 60 "${compose[@]}" logs --no-color --tail 15 2>&1 | sed 's/^/  /'
  fi
  [ ! -s "${run:-}/client.err" ] || sed 's/^/  client: /' "$run/client.err"
  exit 1
}
step() { printf '[compose_test %4d s] %s\n' "$SECONDS" "$*"; }
timing() { printf '[ timing ] %s\n' "$*"; }

why=$(engine_missing)
[ -z "$why" ] || skip "$why"
[ -s "$digits" ] || skip "no $digits (./dev test fetches it from python3-sklearn)"
[ -x "$bin/tessera" ] || fail "no $bin/tessera (build first)"

run=$(mktemp -d /tmp/tessera-compose-test.XXXXXX)
compose=(docker-compose -p "$project" -f "$src/deploy/docker-compose.yml")
export TESSERA_PUBLISH_PORT=0   # any free port on 127.0.0.1: never a clash with the host's
CL_PID=
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ -n "$CL_PID" ]; then kill "$CL_PID" 2>/dev/null || true; fi
  if [ -n "$ENGINE_PID" ]; then
    local clients
    clients=$("$DOCKER" ps -aq --filter "name=^/$project-client-" 2>/dev/null || true)
    [ -z "$clients" ] || "$DOCKER" rm -f $clients >/dev/null 2>&1 || true
    timeout 120 "${compose[@]}" down -v --timeout 5 >/dev/null 2>&1 || echo "warning: docker-compose down failed"
    engine_stop
  fi
  if [ -z "$(awk -v p="$run" 'index($5, p) == 1' /proc/self/mountinfo)" ]; then
    rm -rf --one-file-system "$run"
  else
    echo "warning: something is still mounted below $run; left in place"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
# A command that fails outside the checks below (set -e) says which.
trap 'echo "FAIL: line $LINENO: \`$BASH_COMMAND\` exited with $?"' ERR

step "starting dockerd (data root $TESSERA_CACHE/docker, socket $run/docker.sock)"
rc=0
engine_start "$run" test || rc=$?
((rc != 75)) || skip "another Tessera engine uses $TESSERA_CACHE/docker (./dev compose down stops it)"
((rc != 76)) || skip "this machine cannot run dockerd: $(tail -n 1 "$run/dockerd.log" 2>/dev/null)"
((rc == 0)) || fail "dockerd did not start"
# A run that died may have left this project's containers behind.
leftover=$("$DOCKER" ps -aq --filter "label=com.docker.compose.project=$project")
[ -z "$leftover" ] || { step "removing a dead run's containers"; "$DOCKER" rm -f $leftover >/dev/null; }

# 1. The images.
step "building the image"
start=$SECONDS
engine_build "$src" runtime tessera:latest check tessera-check:latest >"$run/build.log" 2>&1 ||
  { tail -n 60 "$run/build.log"; fail "docker build"; }
timing "image build (both targets, with the wait for the build lock): $((SECONDS - start)) s ($(grep -c ' CACHED$' "$run/build.log") steps cached)"
grep -E '^\[engine\]' "$run/build.log" || true
grep -E '^#[0-9]+ [0-9.]+ +(Hits|Misses):' "$run/build.log" | sed 's/^#[0-9]* [0-9.]* */  ccache: /' || true
size=$("$DOCKER" image inspect -f '{{.Size}}' tessera:latest)
user=$("$DOCKER" image inspect -f '{{.Config.User}}' tessera:latest)
timing "image size: $((size / 1000000)) MB"
((size <= 200 * 1000 * 1000)) || fail "the runtime image is $size bytes, over the 200 MB goal"
[ "$user" = 10001:10001 ] || fail "the image runs as '$user', expected the unprivileged 10001:10001"

# 2. The cluster.
step "docker-compose up"
start=$SECONDS
compose_up=1
timeout 180 "${compose[@]}" up -d --no-build >"$run/up.log" 2>&1 || { cat "$run/up.log"; fail "docker-compose up"; }
engine_wait_healthy "$project" 9 120 || fail "the cluster did not become healthy"
timing "up -> coordinator and 8 workers healthy: $((SECONDS - start)) s"
# Every daemon serves from a read-only root (compose's read_only, as the manifests'
# readOnlyRootFilesystem): healthy there, and the programs below run on it.
for c in $("${compose[@]}" ps -q coordinator) $(for i in 0 1 2 3 4 5 6 7; do "${compose[@]}" ps -q "worker-$i"; done); do
  [ "$("$DOCKER" inspect -f '{{.HostConfig.ReadonlyRootfs}}' "$c")" = true ] ||
    fail "container $("$DOCKER" inspect -f '{{.Name}}' "$c") has a writable root filesystem"
done
published=$("$DOCKER" port "$("${compose[@]}" ps -q coordinator)" 5000/tcp)
case $published in 127.0.0.1:*) ;; *) fail "the coordinator is published on '$published', expected 127.0.0.1 only" ;; esac
# The credentials the one-shot service made (tokens, CA, TLS for 127.0.0.1 too), as a user
# copies them out: docker cp from a container that mounts the volume.
mkdir -m 0700 "$run/credentials"
for f in admin.token ca.pem; do
  "$DOCKER" cp "$("${compose[@]}" ps -q coordinator):/etc/tessera/credentials/$f" "$run/credentials/$f"
done
anonymous=$(timeout 60 "$bin/tessera" status --coordinator="$published" --ca_file="$run/credentials/ca.pem" 2>&1) &&
  fail "tessera status without a token was served: $anonymous"
grep -q UNAUTHENTICATED <<<"$anonymous" || fail "tessera status without a token: $anonymous"
status=$(timeout 60 "$bin/tessera" status --coordinator="$published" --token_file="$run/credentials/admin.token" \
           --ca_file="$run/credentials/ca.pem") || fail "tessera status from the host: $status"
grep -q "devices 8 (8 alive)" <<<"$status" || fail "tessera status from the host: $status"
grep -q "worker-7:6000" <<<"$status" || fail "tessera status does not show worker-7's address: $status"

# 3. The programs, each from a client container on the project's network.
network=${project}_default
# What a client container needs: the volume, its client token and the CA.
credentials=(-v "${project}_credentials:/etc/tessera/credentials:ro"
             -e TESSERA_TOKEN_FILE=/etc/tessera/credentials/client.token -e TESSERA_CA_FILE=/etc/tessera/credentials/ca.pem)
client() {   # client SECONDS IMAGE COMMAND...: runs COMMAND in a new container on the project's network
  local seconds=$1 image=$2; shift 2
  timeout "$seconds" "$DOCKER" run --rm --name "$project-client-$BASHPID" --network "$network" \
    -e TESSERA_COORDINATOR=coordinator:5000 "${credentials[@]}" -v "$digits:/data/digits.csv:ro" "$image" "$@"
}
start=$(date +%s%N)
timeout 60 "$DOCKER" run --rm --network "$network" tessera:latest /bin/sh -c true 2>/dev/null
timing "a container's start and end alone: $((($(date +%s%N) - start) / 1000000)) ms"
start=$(date +%s%N)
# (stderr apart: the docker client warns there that the engine forwards no IPv4, as meant)
seed=$(client 120 tessera:latest example_seed_layer 2>"$run/seed.err") || fail "example_seed_layer: $seed $(cat "$run/seed.err")"
timing "example_seed_layer in a client container: $((($(date +%s%N) - start) / 1000000)) ms"
[ "$seed" = "$(printf '(16, 4)\nP('"'"'data'"'"', '"'"'model'"'"')\n8 (4, 2)')" ] || fail "example_seed_layer printed: $seed"
start=$(date +%s%N)
mlp=$(client 300 tessera:latest example_mlp_train --data=/data/digits.csv 2>"$run/mlp.err") || fail "example_mlp_train: $mlp $(cat "$run/mlp.err")"
timing "example_mlp_train in a client container: $((($(date +%s%N) - start) / 1000000)) ms ($(grep -E '^(test accuracy|mean step time)' <<<"$mlp" | paste -sd ';' -))"
grep -qE '^test accuracy: (0\.9[5-9]|1\.0)' <<<"$mlp" || fail "example_mlp_train's accuracy is below 0.95: $mlp"

# 4. A worker's process dies under a client.
step "a client holding arrays on every device"
coproc CL { timeout 300 "$DOCKER" run --rm -i --name "$project-client-fault" --network "$network" \
              -e TESSERA_COORDINATOR=coordinator:5000 "${credentials[@]}" tessera-check:latest cluster_client \
              2>"$run/client.err"; }
ask() {   # ask COMMAND SECONDS: one line to the client, its one-line answer (or why there is none)
  local answer
  if [ -z "${CL[1]:-}" ]; then
    answer="no answer: the client has exited"
  else
    echo "$1" >&"${CL[1]}"
    read -r -t "$2" answer <&"${CL[0]}" || answer="no answer within $2 s"
  fi
  echo "$answer"
}
ready=$(ask setup 60)
[[ $ready == ready* ]] || fail "setup: $ready"
answer=$(ask run 30)
[[ $answer == ok* ]] || fail "run before the kill: $answer"
# The workers share IPC (TESSERA_WORKER_SHM_HOST): their collectives went through the rings.
shm=$(ask shm 30)
[[ $shm =~ ^shm\ [1-9][0-9]*$ ]] || fail "no collective message came through a shared-memory ring: $shm"
echo "  collective messages through shared-memory rings: ${shm#shm }"
victim=$("${compose[@]}" ps -q worker-3)
restarts=$("$DOCKER" inspect -f '{{.RestartCount}}' "$victim")
pid=$("$DOCKER" inspect -f '{{.State.Pid}}' "$victim")
argv0=$(tr '\0' '\n' <"/proc/$pid/cmdline" | head -n 1)
[ "$argv0" = tessera-worker ] || fail "worker-3's pid $pid runs '$argv0', not tessera-worker"
step "SIGKILL to worker-3's tessera-worker (host pid $pid)"
kill -KILL "$pid"
killed=$(date +%s%N)
failed=$(ask run 30)
timing "kill -> the next call's failure: $((($(date +%s%N) - killed) / 1000000)) ms"
[[ $failed == error* ]] || fail "the call after the kill did not fail: $failed"
[[ $failed == *"device 3"* ]] || fail "the failure does not name device 3: $failed"
echo "  the call after the kill: $failed"
deadline=$((SECONDS + 60))
until [ "$("$DOCKER" inspect -f '{{.RestartCount}} {{.State.Running}}' "$victim")" = "$((restarts + 1)) true" ]; do
  ((SECONDS <= deadline)) || fail "worker-3's container did not restart within 60 s"
  sleep 0.2   # polling, bounded by the deadline above
done
answer=$(ask "wait_devices 8" 40)
[ "$answer" = "devices 8" ] || fail "after the restart: $answer"
timing "kill -> 8 devices registered again: $((($(date +%s%N) - killed) / 1000000)) ms"
ready=$(ask setup 60)
[[ $ready == ready* ]] || fail "setup after the restart: $ready"
timing "kill -> the client served again: $((($(date +%s%N) - killed) / 1000000)) ms"
answer=$(ask run 30)
[[ $answer == ok* ]] || fail "run after the restart: $answer"
echo quit >&"${CL[1]}"
wait "$CL_PID" || fail "the client exited with $?"
CL_PID=

# 5. Down.
step "docker-compose down -v"
timeout 120 "${compose[@]}" down -v --timeout 5 >"$run/down.log" 2>&1 || { cat "$run/down.log"; fail "docker-compose down"; }
left=$("$DOCKER" ps -aq --filter "label=com.docker.compose.project=$project")
[ -z "$left" ] || fail "containers left after down: $left"
! "$DOCKER" network inspect "$network" >/dev/null 2>&1 || fail "network $network left after down"
step "ok"
