#!/usr/bin/env bash
# Run compose.yaml for real on a machine that reaches Debian's mirror and PyPI but no container registry: the
# base image is a Debian bookworm rootfs made with debootstrap, imported into the engine, and passed to the
# Dockerfile as BASE (CORTEX_BASE_IMAGE). Then: build, up, one chat through the public port, the same chat again
# (an exact KV hit on the same worker), the admin token, which ports are published where, and down.
# ENGINE=podman (default: podman + podman-compose) or ENGINE=docker (docker + `docker compose` or docker-compose;
# with no Docker daemon answering, a private dockerd is started on a socket under $STATE and stopped at exit).
# Needs root (debootstrap, the engines' bridge networks) and a few minutes of downloads the first time; not part
# of the test suite (docs/deployment/compose-run.md says what it showed).
#
#   sudo scripts/compose-smoke.sh          # KEEP=1 leaves the stack up; REBUILD_BASE=1 redoes debootstrap
#   sudo ENGINE=docker scripts/compose-smoke.sh
set -euo pipefail
cd "$(dirname "$0")/.."

STATE=${CORTEX_SMOKE_DIR:-/var/tmp/cortex-compose}       # the rootfs, containers.conf and logs
BASE=${CORTEX_BASE_IMAGE:-localhost/cortex-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
ENGINE=${ENGINE:-podman}
PROJECT=${COMPOSE_PROJECT:-cortex-smoke-$ENGINE}
CA=${CORTEX_BUILD_CA:-/etc/ssl/certs/ca-certificates.crt} # the host's trust store, for pip inside the build
MODEL=Qwen/Qwen2.5-7B-Instruct

fail() { echo "compose-smoke: FAIL: $*" >&2; exit 1; }
say() { echo "compose-smoke: $*"; }

[ "$(id -u)" = 0 ] || fail "run as root (debootstrap and the engine's bridge network need it)"
case $ENGINE in
  podman) packages=(podman podman-compose debootstrap runc curl); tools=("${packages[@]}") ;;
  docker) packages=(docker.io docker-compose debootstrap curl); tools=(docker dockerd debootstrap curl) ;;
  *) fail "ENGINE is podman or docker, not $ENGINE" ;;
esac
missing=()
for tool in "${tools[@]}"; do command -v "$tool" >/dev/null || missing+=("$tool"); done
[ "$ENGINE" = docker ] && ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null \
  && missing+=(docker-compose)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${packages[*]} from apt (missing: ${missing[*]})"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null
fi
mkdir -p "$STATE"

# podman's defaults that a locked-down host refuses, overridden for this script's podman calls only:
# - root podman asks for nofile=1048576 and nproc=4194304; without CAP_SYS_RESOURCE the runtime cannot raise a
#   hard limit, so ask for what this shell has (nproc at most 32768: podman lowers conmon's to that);
# - crun refuses a hybrid cgroup v1 + v2 host ("cgroups in hybrid mode not supported"); runc runs there.
nofile=$(ulimit -Hn); nproc=$(ulimit -Hu)
[ "$nofile" = unlimited ] && nofile=1048576
{ [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ]; } && nproc=32768
cat > "$STATE/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "runc"
EOF
export CONTAINERS_CONF=$STATE/containers.conf

dockerd_pid=
if [ "$ENGINE" = docker ]; then
  if ! docker info >/dev/null 2>&1; then
    # No daemon (or not this one's socket): a private dockerd whose files and socket stay under $STATE.
    export DOCKER_HOST=unix://$STATE/docker/docker.sock
    if ! docker info >/dev/null 2>&1; then
      mkdir -p "$STATE/docker"
      dockerd --data-root "$STATE/docker/root" --exec-root "$STATE/docker/exec" -H "$DOCKER_HOST" \
        --pidfile "$STATE/docker/dockerd.pid" >"$STATE/docker/dockerd.log" 2>&1 &
      dockerd_pid=$!
      deadline=$(( $(date +%s) + 60 ))
      until docker info >/dev/null 2>&1; do
        [ "$(date +%s)" -lt "$deadline" ] || fail "dockerd did not start: see $STATE/docker/dockerd.log"
        sleep 1
      done
      say "started a private dockerd (pid $dockerd_pid, $DOCKER_HOST)"
    fi
  fi
  if docker compose version >/dev/null 2>&1; then compose() { docker compose -p "$PROJECT" "$@"; }
  else compose() { docker-compose -p "$PROJECT" "$@"; }; fi
else
  compose() { podman-compose -p "$PROJECT" "$@"; }
fi
engine() { "$ENGINE" "$@"; }

# 1. The base image: Python 3.11, pip and `python` from Debian packages, no registry.
if [ "${REBUILD_BASE:-0}" = 1 ] || ! engine image inspect "$BASE" >/dev/null 2>&1; then
  say "debootstrap bookworm from $MIRROR (log: $STATE/debootstrap.log)"
  rm -rf "$STATE/rootfs"
  debootstrap --variant=minbase --include=python3,python3-pip,python-is-python3,ca-certificates \
    bookworm "$STATE/rootfs" "$MIRROR" >"$STATE/debootstrap.log" 2>&1 || fail "debootstrap: see $STATE/debootstrap.log"
  rm -rf "$STATE"/rootfs/var/cache/apt/archives/*.deb "$STATE"/rootfs/var/lib/apt/lists/*
  old=$(engine image inspect --format '{{.Id}}' "$BASE" 2>/dev/null || true)
  tar -C "$STATE/rootfs" -c . | engine import --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
  [ -z "$old" ] || engine rmi "$old" >/dev/null 2>&1 || true   # the replaced base, unless images still use it
  rm -rf "$STATE/rootfs"
fi
say "base image $BASE: $(engine run --rm "$BASE" python --version 2>&1)"
# pip inside the build trusts what the host trusts (an egress proxy may re-sign TLS). podman mounts the host's
# trust store into the build; Docker's builder cannot mount, so a local layer on the base carries it.
build_args=()
export CORTEX_BASE_IMAGE=$BASE
if [ -f "$CA" ]; then
  if [ "$ENGINE" = podman ]; then
    build_args=("--podman-build-args=-v $CA:/etc/ssl/certs/ca-certificates.crt:ro")  # "=": the value starts with -
  else
    ctx=$(mktemp -d); cp "$CA" "$ctx/ca-certificates.crt"
    printf 'FROM %s\nCOPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt\n' "$BASE" >"$ctx/Dockerfile"
    docker build -q -t "$BASE-hostca" "$ctx" >/dev/null || fail "the trust-store layer did not build"
    rm -rf "$ctx"
    export CORTEX_BASE_IMAGE=$BASE-hostca
  fi
fi

# 2. The admin token compose.yaml mounts as a secret (gitignored; made once, like the comment in compose.yaml).
[ -s deploy/admin-token ] || (umask 077 && openssl rand -hex 24 > deploy/admin-token)
token=$(cat deploy/admin-token)

for port in 8080 9090; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then fail "port $port is in use on this host"; fi
done

cleanup() {
  if [ "${KEEP:-0}" = 1 ]; then say "KEEP=1: stack left up ($ENGINE, project $PROJECT)"; return; fi
  compose down >"$STATE/down.log" 2>&1 || true
  [ "$ENGINE" = docker ] || podman network rm -f "${PROJECT}_default" >/dev/null 2>&1 || true
  if [ -n "$dockerd_pid" ]; then kill "$dockerd_pid" 2>/dev/null && wait "$dockerd_pid" 2>/dev/null || true; fi
}
trap cleanup EXIT

# 3. Build (one image, tagged per service) and start.
say "building with $ENGINE (log: $STATE/build.log)"
started=$(date +%s)
compose "${build_args[@]}" build >"$STATE/build.log" 2>&1 || fail "build: see $STATE/build.log"
say "built in $(( $(date +%s) - started ))s"
compose up -d >"$STATE/up.log" 2>&1 || fail "up: see $STATE/up.log"
cortex=$(engine ps --filter "label=com.docker.compose.project=$PROJECT" \
                  --filter "label=com.docker.compose.service=cortex" --format '{{.Names}}')
[ -n "$cortex" ] || fail "no cortex container (see $STATE/up.log)"

# 4. Ready: compose.yaml's healthcheck passes. Docker runs it on its interval; podman needs systemd timers for
# that, which a machine without systemd lacks, so here podman runs it on demand.
healthy() {
  if [ "$ENGINE" = podman ]; then podman healthcheck run "$cortex" >/dev/null 2>&1
  else [ "$(docker inspect --format '{{.State.Health.Status}}' "$cortex")" = healthy ]; fi
}
deadline=$(( $(date +%s) + 180 ))
until healthy; do
  [ "$(date +%s)" -lt "$deadline" ] || { engine logs "$cortex" 2>&1 | tail -30; fail "not ready in 180s"; }
  sleep 2
done
say "ready: healthcheck healthy, $(curl -s -m 5 127.0.0.1:9090/health/ready | head -c 120)..."

# 5. One chat through the public port, then the same chat again: the second must be an exact KV hit.
chat='{"model":"'$MODEL'","max_tokens":8,"messages":[{"role":"system","content":"You are a careful assistant
 who answers questions about the history of Roman aqueducts in great detail, citing engineering facts."},
 {"role":"user","content":"How did the Aqua Appia carry water into Rome?"}]}'
chat=${chat//$'\n'/}
send() { curl -s -m 30 -D - -o "$STATE/chat.json" -H 'content-type: application/json' -d "$chat" "$1"; }
header() { grep -i "^$1:" | tr -d '\r' | cut -d' ' -f2; }
first=$(send http://127.0.0.1:8080/v1/chat/completions)
grep -q '^HTTP/1.1 200' <<<"$first" || fail "chat: $first $(cat "$STATE/chat.json")"
grep -q '"chat.completion"' "$STATE/chat.json" || fail "chat body: $(cat "$STATE/chat.json")"
worker=$(header x-cortex-assigned-worker <<<"$first")
say "chat 1: 200 from $worker ($(header x-cortex-match-mode <<<"$first"), $(header x-cortex-route-reason <<<"$first"))"
# Wait (bounded) until the worker's BlockStored events are in the ledger: route explain (admin port, token)
# shows the decision without sending anything.
deadline=$(( $(date +%s) + 15 ))
explain() { curl -s -m 5 -H "authorization: Bearer $token" -H 'content-type: application/json' -d "$chat" \
              http://127.0.0.1:9090/cortex/v1/route || true; }
until e=$(explain) && grep -q "\"chosen\":\"$worker\"" <<<"$e" && grep -q '"mode":"exact_kv_events"' <<<"$e"; do
  [ "$(date +%s)" -lt "$deadline" ] || fail "route explain never showed the first chat's blocks on $worker"
  sleep 0.2
done
second=$(send http://127.0.0.1:8080/v1/chat/completions)
mode=$(header x-cortex-match-mode <<<"$second"); hit=$(header x-cortex-cache-hit-tokens <<<"$second")
say "chat 2: $(header x-cortex-assigned-worker <<<"$second"), $mode, $hit cached tokens"
[ "$mode" = exact_kv_events ] && [ "${hit:-0}" -gt 0 ] && [ "$(header x-cortex-assigned-worker <<<"$second")" = "$worker" ] \
  || fail "second chat was not an exact KV hit on $worker: $second"

# 6. The admin plane: token required; only 8080 published beyond loopback; Envoy admin not published at all.
code() { curl -s -m 5 -o /dev/null -w '%{http_code}' "$@" || true; }
[ "$(code http://127.0.0.1:9090/cortex/workers)" = 401 ] || fail "admin route without token is not 401"
[ "$(code -H "authorization: Bearer $token" http://127.0.0.1:9090/cortex/workers)" = 200 ] \
  || fail "admin route with the token is not 200"
say "admin: /cortex/workers 401 without the token, 200 with it"
# Docker also lists 8080 on [::]; anything else than 8080 (any address) and 9090 on 127.0.0.1 fails.
published=$(engine port "$cortex" | sort | tr '\n' ' ')
say "published: $published"
others=$(engine port "$cortex" | grep -v '^8080/tcp -> ' || true)
[ "$others" = "9090/tcp -> 127.0.0.1:9090" ] && grep -q '^8080/tcp' <<<"$(engine port "$cortex")" \
  || fail "unexpected published ports"
ip=$(ip -4 route get 1.1.1.1 2>/dev/null | sed -n 's/.* src \([0-9.]*\).*/\1/p')
if [ -n "$ip" ]; then
  [ "$(code -H 'content-type: application/json' -d "$chat" "http://$ip:8080/v1/chat/completions")" = 200 ] \
    || fail "public port not reachable on $ip"
  for port in 9090 9901; do
    [ "$(code "http://$ip:$port/")" = 000 ] || fail "port $port answers on $ip"
  done
  say "from $ip (not loopback): 8080 answers; 9090 and 9901 refuse"
fi
say "PASS"
