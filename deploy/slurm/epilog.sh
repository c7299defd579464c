#!/bin/bash
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/ps-offload-epilog.sh), run as root on every node
# of a job after it ends. The daemon is the node's, not the job's: it keeps serving (its models
# stay on NVMe for the next job, and ps-admin drop deletes them). Set PS_DAEMON_STOP=1 to stop
# it after each job instead (a node shared by jobs of different users, say): SIGTERM drains
# in-flight calls and every acknowledged update is on disk already.
set -euo pipefail
if [[ "${PS_DAEMON_STOP:-0}" == "1" ]]; then
    systemctl stop "${PS_DAEMON_UNIT:-ps-daemon.service}"
fi
