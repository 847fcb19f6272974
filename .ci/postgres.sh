#!/usr/bin/env bash
# A throw-away PostgreSQL 15 cluster for tests and CI, on loopback only.
#   .ci/postgres.sh start   initdb + start (idempotent); prints the URL and writes it to $DIR/url
#   .ci/postgres.sh url     prints the URL of the running cluster
#   .ci/postgres.sh stop    stops the cluster and removes $DIR (idempotent)
#   .ci/postgres.sh pause   stops the server, keeping its data (an outage, for tests)
#   .ci/postgres.sh resume  starts a paused server again on the same port
# DIR is $FUSIONLAB_PG_DIR (default /tmp/fusionlab-pg-ci); PG_BIN overrides the binaries' folder.
# PostgreSQL refuses to run as root, so as root the cluster belongs to a non-root user
# ($FUSIONLAB_PG_USER, default `postgres`, created with useradd when missing).
set -euo pipefail

DIR="${FUSIONLAB_PG_DIR:-/tmp/fusionlab-pg-ci}"
PG_BIN="${PG_BIN:-/usr/lib/postgresql/15/bin}"
DATA="$DIR/data"

die() { echo "postgres.sh: $*" >&2; exit 1; }

[[ -x "$PG_BIN/initdb" && -x "$PG_BIN/pg_ctl" ]] || die "no PostgreSQL binaries in $PG_BIN (set PG_BIN)"

if [[ "$(id -u)" == 0 ]]; then
    OWNER="${FUSIONLAB_PG_USER:-postgres}"
    id -u "$OWNER" >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin "$OWNER"
    as_owner() { runuser -u "$OWNER" -- "$@"; }
else
    OWNER="$(id -un)"
    as_owner() { "$@"; }
fi

running() { [[ -f "$DATA/PG_VERSION" ]] && as_owner "$PG_BIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1; }

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start() {
    if running && [[ -f "$DIR/url" ]]; then
        cat "$DIR/url"
        return
    fi
    rm -rf "$DIR"
    mkdir -p "$DIR"
    chown "$OWNER" "$DIR"
    chmod 700 "$DIR"
    # trust on loopback only: this cluster lives for one test session and listens on 127.0.0.1.
    as_owner "$PG_BIN/initdb" -D "$DATA" -U "$OWNER" -A trust --no-sync -E UTF8 >"$DIR/initdb.log" 2>&1 \
        || die "initdb failed: $(tail -n 3 "$DIR/initdb.log")"
    local port
    # A port picked free can be taken before the server binds it; try another.
    for _ in 1 2 3 4 5; do
        port="$(free_port)"
        echo "$port" >"$DIR/port"
        if serve "$port"; then
            as_owner "$PG_BIN/createdb" -h 127.0.0.1 -p "$port" -U "$OWNER" fusionlab \
                || die "createdb failed"
            echo "postgresql+psycopg://$OWNER@127.0.0.1:$port/fusionlab" >"$DIR/url"
            cat "$DIR/url"
            return
        fi
    done
    die "the server did not start: $(tail -n 3 "$DIR/server.log" 2>/dev/null)"
}

serve() {
    as_owner "$PG_BIN/pg_ctl" -D "$DATA" -l "$DIR/server.log" -w -t 20 start -o \
        "-c listen_addresses=127.0.0.1 -p $1 -k $DIR -c max_connections=300 \
         -c shared_buffers=32MB -c fsync=off -c synchronous_commit=off \
         -c full_page_writes=off" >/dev/null 2>&1
}

stop() {
    if running; then
        as_owner "$PG_BIN/pg_ctl" -D "$DATA" -m immediate -w stop >/dev/null 2>&1 || true
    fi
    rm -rf "$DIR"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    pause) running || die "no cluster running in $DIR"
           as_owner "$PG_BIN/pg_ctl" -D "$DATA" -m fast -w stop >/dev/null ;;
    resume) [[ -f "$DIR/port" ]] || die "no cluster in $DIR"
            serve "$(cat "$DIR/port")" || die "the server did not start again" ;;
    url) [[ -f "$DIR/url" ]] && running || die "no cluster running in $DIR"; cat "$DIR/url" ;;
    *) die "usage: $0 start|stop|url|pause|resume" ;;
esac
