# deploy/engine.sh: the Docker side of `./dev compose` and tests/deploy/compose_test.sh
# (bash; sourced by both, never run).
#
#   source deploy/engine.sh
#   engine_start "$run_dir" test        # a private dockerd; sets DOCKER_HOST
#   engine_base_image                   # a Debian 12 base made with debootstrap, once
#   engine_build . runtime tessera:latest  # deploy/Dockerfile, under the shared build lock
#   engine_stop                         # by pid
#
# The engine is a dockerd of our own: its socket, exec root and pid file in the caller's run
# folder; its data root (images, build cache, the compile's ccache) in $TESSERA_CACHE/docker,
# kept between runs. One engine at a time may use that data root: a lock on
# $TESSERA_CACHE/docker.lock is held for as long as the engine lives (dockerd inherits it).
# It touches neither the host's firewall nor its forwarding (--iptables=false,
# --ip-forward=false, no default bridge): containers reach each other on the project's own
# bridge network and the host through ports published on 127.0.0.1, nothing else. Builds use
# the host's network (--network=host), for apt-get and nothing else.

TESSERA_CACHE=${TESSERA_CACHE:-/var/cache/tessera}
# dockerd and debootstrap live in sbin, which a root shell may not have on its PATH.
case ":$PATH:" in *:/usr/sbin:*) ;; *) PATH=$PATH:/usr/sbin:/sbin ;; esac
# The base image made here when no registry serves debian:bookworm-slim.
TESSERA_LOCAL_BASE=tessera-base:bookworm
# Debian's docker.io client (BuildKit built in), before any other docker on PATH.
if [ -x /usr/bin/docker ]; then DOCKER=/usr/bin/docker; else DOCKER=docker; fi
ENGINE_PID=
ENGINE_RUN=

engine_log() { printf '[engine] %s\n' "$*" >&2; }

# engine_missing: prints what this machine lacks to run an engine (empty when nothing).
engine_missing() {
  local missing=() tool
  [ "$(id -u)" -eq 0 ] || { echo "not root (a private dockerd needs root)"; return; }
  for tool in dockerd "$DOCKER" docker-compose debootstrap unshare flock; do
    command -v "$tool" >/dev/null || missing+=("$tool")
  done
  ((${#missing[@]} == 0)) || echo "${missing[*]} not installed (./dev install brings docker.io, docker-compose, debootstrap)"
}

# engine_alive PID: whether PID is a dockerd.
engine_alive() { [ -n "$1" ] && [ "$(readlink "/proc/$1/exe" 2>/dev/null)" = "$(readlink -f "$(command -v dockerd)")" ]; }

# engine_start RUN_DIR OWNER [setsid]: starts dockerd with its socket, exec root and pid file in
# RUN_DIR and exports DOCKER_HOST. OWNER (test, compose) is recorded in $TESSERA_CACHE/engine
# with our pid, so that a later run can tell a leftover of a dead run from a live engine.
# Returns 75 when a live engine of another run holds the data root, 1 when dockerd did not
# answer within 60 s (its log is printed).
engine_start() {
  local run=$1 owner=$2 detach=${3:-}
  mkdir -p "$TESSERA_CACHE" "$run"
  exec {ENGINE_LOCK_FD}>>"$TESSERA_CACHE/docker.lock"
  if ! flock -n "$ENGINE_LOCK_FD"; then
    local pid='' who='' by=''
    # shellcheck disable=SC1091
    [ -f "$TESSERA_CACHE/engine" ] && . "$TESSERA_CACHE/engine" && pid=${engine_pid:-} who=${engine_owner:-} by=${engine_owner_pid:-}
    if [ "$who" = test ] && engine_alive "$pid" && ! kill -0 "$by" 2>/dev/null; then
      engine_log "stopping the engine a dead test run left (pid $pid)"
      ENGINE_PID=$pid engine_stop
      flock -w 30 "$ENGINE_LOCK_FD" || return 75
    else
      engine_log "another Tessera engine uses $TESSERA_CACHE/docker (${who:-unknown} run, dockerd pid ${pid:-unknown})"
      exec {ENGINE_LOCK_FD}>&-
      return 75
    fi
  fi
  # Bounded: the build cache is collected past 8 GB, container logs rotate at 2 x 10 MB.
  cat > "$run/daemon.json" <<'JSON'
{ "features": { "buildkit": true },
  "builder": { "gc": { "enabled": true, "defaultKeepStorage": "8GB" } },
  "log-driver": "json-file", "log-opts": { "max-size": "10m", "max-file": "2" } }
JSON
  local args=(--config-file "$run/daemon.json" --host "unix://$run/docker.sock" --pidfile "$run/dockerd.pid"
              --data-root "$TESSERA_CACHE/docker" --exec-root "$run/exec" --bridge=none --iptables=false
              --ip-forward=false --default-address-pool base=10.214.0.0/16,size=24 --log-level=warn)
  # dockerd gets the data-root lock and nothing else of ours (a build lock inherited from
  # `flock ... ctest` must not outlive the build).
  (
    cd /
    for fd in $(ls "/proc/$BASHPID/fd"); do
      [ "$fd" -gt 2 ] && [ "$fd" != "$ENGINE_LOCK_FD" ] && eval "exec $fd>&-" 2>/dev/null
    done
    if [ "$detach" = setsid ]; then exec setsid dockerd "${args[@]}"; else exec dockerd "${args[@]}"; fi
  ) </dev/null >"$run/dockerd.log" 2>&1 &
  ENGINE_PID=$!
  ENGINE_RUN=$run
  printf 'engine_pid=%s\nengine_owner=%s\nengine_owner_pid=%s\nengine_socket=%s\n' \
    "$ENGINE_PID" "$owner" "$$" "$run/docker.sock" > "$TESSERA_CACHE/engine"
  export DOCKER_HOST="unix://$run/docker.sock"
  local deadline=$((SECONDS + 60))
  until "$DOCKER" version >/dev/null 2>&1; do
    if ! kill -0 "$ENGINE_PID" 2>/dev/null; then
      # It exited by itself: this machine cannot run it (a chroot without cgroups, say).
      engine_log "dockerd exited at start; its log:"
      tail -n 30 "$run/dockerd.log" >&2
      engine_stop
      return 76
    fi
    if ((SECONDS > deadline)); then
      engine_log "dockerd did not answer within 60 s; its log:"
      tail -n 30 "$run/dockerd.log" >&2
      engine_stop
      return 1
    fi
    sleep 0.2   # polling, bounded by the deadline above
  done
}

# engine_stop: SIGTERM to our dockerd (it stops its containers), SIGKILL after 30 s.
engine_stop() {
  local pid=$ENGINE_PID i
  [ -n "$pid" ] || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 300; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    engine_log "dockerd $pid still runs 30 s after SIGTERM: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
  ENGINE_PID=
  rm -f "$TESSERA_CACHE/engine"
}

# engine_debian_mirror: the URI this machine's apt fetches bookworm's main from.
engine_debian_mirror() {
  apt-cache policy 2>/dev/null | awk '$3 == "bookworm/main" && $2 ~ /^https?:/ { print $2; exit }'
}

# engine_base_image: prints the base image to build from: debian:bookworm-slim when the engine
# has it, else $TESSERA_LOCAL_BASE, made the first time with debootstrap (minbase, from the
# mirror this machine's apt uses, with its apt sources and settings) and docker import'ed.
engine_base_image() {
  if "$DOCKER" image inspect debian:bookworm-slim >/dev/null 2>&1; then echo debian:bookworm-slim; return; fi
  if "$DOCKER" image inspect "$TESSERA_LOCAL_BASE" >/dev/null 2>&1; then echo "$TESSERA_LOCAL_BASE"; return; fi
  local mirror tmp start=$SECONDS
  mirror=$(engine_debian_mirror)
  [ -n "$mirror" ] || { engine_log "no bookworm/main in this machine's apt sources: cannot debootstrap"; return 1; }
  rm -rf --one-file-system "$TESSERA_CACHE"/debootstrap.*   # a killed run's (we hold the lock)
  tmp=$(mktemp -d "$TESSERA_CACHE/debootstrap.XXXXXX")
  engine_log "making $TESSERA_LOCAL_BASE: debootstrap --variant=minbase bookworm from $mirror (a few minutes, once)"
  # Its own mount namespace: whatever debootstrap mounts inside the root goes with it.
  if ! timeout 1200 unshare --mount --propagation private \
         debootstrap --variant=minbase bookworm "$tmp/root" "$mirror" >"$tmp/log" 2>&1; then
    tail -n 20 "$tmp/log" >&2
    engine_log "debootstrap failed"
    rm -rf --one-file-system "$tmp"
    return 1
  fi
  local r=$tmp/root f
  # This machine's apt sources and the settings that reach the mirror (proxy, date checks).
  rm -f "$r/etc/apt/sources.list" "$r"/etc/apt/sources.list.d/*
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] && cp -L "$f" "$r$f"
  done
  for f in /etc/apt/apt.conf.d/*; do
    [ -f "$f" ] && grep -qiE 'proxy|check-valid-until|check-date' "$f" && cp -L "$f" "$r$f"
  done
  rm -rf "$r"/var/lib/apt/lists/* "$r"/var/cache/apt/archives/*.deb "$r"/var/cache/apt/*.bin
  tar -C "$r" --numeric-owner -cf - . |
    "$DOCKER" import -c 'CMD ["/bin/bash"]' -m "debootstrap --variant=minbase bookworm $mirror" - "$TESSERA_LOCAL_BASE" >/dev/null
  local rc=$?
  rm -rf --one-file-system "$tmp"
  ((rc == 0)) || { engine_log "docker import failed"; return 1; }
  engine_log "made $TESSERA_LOCAL_BASE in $((SECONDS - start)) s"
  echo "$TESSERA_LOCAL_BASE"
}

# with_build_lock COMMAND...: runs COMMAND under flock /tmp/tessera-build.lock, as every build
# on these machines, unless one of our ancestors holds that lock already (`flock ... ctest`):
# taking it again would wait for ourselves.
with_build_lock() {
  local lock=/tmp/tessera-build.lock inode pid
  touch "$lock" 2>/dev/null || true
  inode=$(stat -c %i "$lock")
  for pid in $(awk -v i=":$inode" '$2 == "FLOCK" && index($6, i) == length($6) - length(i) + 1 { print $5 }' /proc/locks); do
    local p=$$
    while [ -n "$p" ] && [ "$p" -gt 1 ]; do
      [ "$p" = "$pid" ] && { "$@"; return; }
      p=$(awk '{ print $4 }' "/proc/$p/stat" 2>/dev/null)
    done
  done
  local fd rc=0 t=$SECONDS
  exec {fd}>>"$lock"
  flock "$fd"
  ((SECONDS - t < 2)) || engine_log "waited $((SECONDS - t)) s for $lock"
  "$@" || rc=$?
  exec {fd}>&-
  return "$rc"
}

# engine_build SOURCE_DIR TARGET TAG [TARGET TAG ...]: builds deploy/Dockerfile's TARGETs as
# TAGs from SOURCE_DIR, on the base engine_base_image picks, under one hold of the build lock.
engine_build() {
  local src=$1 base
  shift
  base=$(engine_base_image) || return 1
  with_build_lock engine_build_locked "$src" "$base" "$@"
}

engine_build_locked() {
  local src=$1 base=$2 start
  shift 2
  while (($# >= 2)); do
    engine_log "docker build --target $1 -t $2 on $base"
    start=$SECONDS
    DOCKER_BUILDKIT=1 "$DOCKER" build --network=host --progress=plain --build-arg "BASE=$base" \
      --target "$1" -t "$2" -f "$src/deploy/Dockerfile" "$src" || return 1
    engine_log "built $2 in $((SECONDS - start)) s"
    shift 2
  done
  # The images the new tags replaced (the build cache has its own bound, above).
  "$DOCKER" image prune -f >/dev/null
}

# engine_healthy PROJECT: how many of the compose project's containers are healthy.
engine_healthy() {
  "$DOCKER" ps -q --filter "label=com.docker.compose.project=$1" --filter health=healthy | wc -l
}

# engine_wait_healthy PROJECT COUNT SECONDS: waits until COUNT containers of PROJECT are
# healthy; fails naming the ones that are not when SECONDS pass.
engine_wait_healthy() {
  local project=$1 count=$2 deadline=$((SECONDS + $3))
  until [ "$(engine_healthy "$project")" -ge "$count" ]; do
    if ((SECONDS > deadline)); then
      engine_log "after $3 s, $(engine_healthy "$project") of $count healthy:"
      "$DOCKER" ps -a --filter "label=com.docker.compose.project=$project" --format '{{.Names}}: {{.Status}}' >&2
      return 1
    fi
    sleep 0.2   # polling, bounded by the deadline above
  done
}
