#!/bin/sh
# Runs the compose stack's federated run to its end and returns the run's exit code.
#
#   docker/up.sh            # the cpu profile: a SuperLink, the runner, 21 silos {3,6,6,6}
#   docker/up.sh laptop     # 7 silos {1,2,2,2}
#   docker/up.sh gpu        # each silo on its own GPU
#
# Why not `docker compose up --exit-code-from <runner>`: that implies
# --abort-on-container-exit, so one silo's crash stopped every container and the run was lost.
# Here every container starts detached (a silo that crashes is restarted by Docker and rejoins
# under its node id; one that stays down is a dropped silo to the server), the runner's log is
# followed, and when the runner exits the stack is stopped (volumes, ledgers and results kept)
# and its exit code returned. Ctrl-C stops the stack too. Extra arguments go to every
# `docker compose` call before the subcommand (e.g. -f compose.yaml -f my-override.yaml).
set -eu

profile=${1:-cpu}
[ $# -gt 0 ] && shift
case "$profile" in
    cpu) runner=serverapp ;;
    laptop) runner=laptop-serverapp ;;
    gpu) runner=gpu-serverapp ;;
    *) echo "usage: docker/up.sh [cpu|laptop|gpu] [docker compose options]" >&2; exit 2 ;;
esac

compose() {
    docker compose --profile "$profile" "$@"
}

stop_stack() {
    echo "docker/up.sh: stopping the stack (volumes and results are kept)" >&2
    compose "$@" stop --timeout 30 >/dev/null 2>&1 || true
}

trap 'stop_stack "$@"; exit 130' INT TERM

compose "$@" up --detach --quiet-pull
compose "$@" logs --follow --no-log-prefix "$runner" &
follower=$!
# `wait` returns once the runner's container has stopped (what it prints differs between
# Compose releases); its exit code is the container's, as Docker recorded it.
compose "$@" wait "$runner" >/dev/null || true
container=$(compose "$@" ps --all --quiet "$runner" | tail -n 1)
code=$(docker inspect --format '{{.State.ExitCode}}' "$container" 2>/dev/null || true)
kill "$follower" 2>/dev/null || true
wait "$follower" 2>/dev/null || true
stop_stack "$@"
case "$code" in
    ''|*[!0-9]*) echo "docker/up.sh: no exit code from $runner ($code)" >&2; exit 1 ;;
esac
echo "docker/up.sh: $runner exited with $code" >&2
exit "$code"
