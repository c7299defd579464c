#!/bin/bash
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/ps-offload-prolog.sh), run as root on every node
# of a job before it starts. Makes sure the node's ps-daemon serves: starts the systemd unit
# if it is not running, then waits until its health check answers SERVING (every shard under
# nvme_dir recovered). A non-zero exit drains the node, as Slurm does for a failed prolog; why
# goes to stderr (slurmd's log) and to syslog (tag ps-offload-prolog).
#
# Settings: the environment, after the file $PS_OFFLOAD_SETTINGS (default
# /etc/default/ps-offload) is read if it exists. ps-admin's own variables reach the daemon as
# the trainers do: PS_TLS_CA_FILE (the CA that signed the daemon's certificate: TLS on),
# PS_TLS_CERT_FILE / PS_TLS_KEY_FILE (mutual TLS), PS_TOKEN_FILE, PS_TLS_SERVER_NAME (the name
# on the daemon's certificate; default this node's `hostname -f`, as 127.0.0.1 is dialled).
# Also PS_DAEMON_UNIT, PS_DAEMON_CONFIG (the daemon's TOML, default
# /etc/ps-daemon/ps-daemon.toml: its server.listen port is the one asked), PS_DAEMON_PORT (that
# port, instead), PS_ADMIN (the ps-admin command), PS_DAEMON_WAIT (seconds).
set -euo pipefail
settings="${PS_OFFLOAD_SETTINGS:-/etc/default/ps-offload}"
if [[ -r "$settings" ]]; then
    set -a  # the file's assignments reach ps-admin
    # shellcheck disable=SC1090
    . "$settings"
    set +a
fi
unit="${PS_DAEMON_UNIT:-ps-daemon.service}"
config="${PS_DAEMON_CONFIG:-/etc/ps-daemon/ps-daemon.toml}"
read -r -a admin <<< "${PS_ADMIN:-/opt/ps-offload/bin/ps-admin}"
wait="${PS_DAEMON_WAIT:-300}"

say() {
    echo "ps-offload prolog: $*" >&2
    logger -t ps-offload-prolog -- "$*" 2>/dev/null || true
}

port="${PS_DAEMON_PORT:-}"
if [[ -z "$port" ]]; then
    # The port the daemon listens on, from its own config: [server] listen's last field (not
    # [metrics] listen, which has a key of the same name).
    listen=$(awk '/^[[:space:]]*\[/ { server = ($0 ~ /^[[:space:]]*\[server\]/) }
                  server && /^[[:space:]]*listen[[:space:]]*=/ { sub(/^[^"]*"/, ""); sub(/".*/, ""); print; exit }' \
             "$config" 2>/dev/null || true)
    port="${listen##*:}"
    port="${port:-50051}"
fi
if [[ -n "${PS_TLS_CA_FILE:-}" && -z "${PS_TLS_SERVER_NAME:-}" ]]; then
    export PS_TLS_SERVER_NAME
    PS_TLS_SERVER_NAME=$(hostname -f 2>/dev/null || hostname)
fi

if ! systemctl is-active --quiet "$unit"; then
    systemctl start "$unit"  # Type=notify: returns once READY=1 (recovered, listening)
fi
deadline=$((SECONDS + wait))
until answer=$("${admin[@]}" health --daemon "127.0.0.1:$port" --timeout 5 2>&1); do
    if ((SECONDS >= deadline)); then
        say "the ps-daemon on $(hostname) did not answer SERVING on port $port in ${wait}s; draining. ps-admin said: ${answer:-nothing}"
        exit 1
    fi
    sleep 2
done
