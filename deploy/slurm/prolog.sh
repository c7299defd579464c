#!/bin/bash
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/ps-offload-prolog.sh), run as root on every node
# of a job before it starts. Makes sure the node's ps-daemon serves: starts the systemd unit
# if it is not running, then waits until its health check answers SERVING (every shard under
# nvme_dir recovered). A non-zero exit drains the node, as Slurm does for a failed prolog.
# Settings (environment, e.g. from /etc/default/ps-offload): PS_DAEMON_UNIT, PS_DAEMON_PORT,
# PS_ADMIN (the ps-admin executable), PS_DAEMON_WAIT (seconds).
set -euo pipefail
unit="${PS_DAEMON_UNIT:-ps-daemon.service}"
port="${PS_DAEMON_PORT:-50051}"
admin="${PS_ADMIN:-/opt/ps-offload/bin/ps-admin}"
wait="${PS_DAEMON_WAIT:-300}"

if ! systemctl is-active --quiet "$unit"; then
    systemctl start "$unit"  # Type=notify: returns once READY=1 (recovered, listening)
fi
deadline=$((SECONDS + wait))
until "$admin" health --daemon "127.0.0.1:$port" --timeout 5 >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
        echo "ps-offload prolog: the ps-daemon on $(hostname) did not answer SERVING on port $port in ${wait}s" >&2
        exit 1
    fi
    sleep 2
done
