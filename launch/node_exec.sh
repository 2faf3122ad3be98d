#!/bin/bash
# Runs one command on a node (the Slurm templates start every step through it): the job's working
# directory and environment, then exec, so the command's exit status and signals are the step's.
#   launch/node_exec.sh CMD [ARGS...]
# Reads WORKDIR (the repository, shared by all nodes) and VENV (a virtualenv to activate; ignored inside a
# container, whose image provides the environment).
set -euo pipefail
cd "${WORKDIR:-$PWD}"
# shellcheck source=launch/env.sh
source launch/env.sh
if [[ -n ${VENV:-} && -z ${CONTAINER:-} ]]; then
    # shellcheck disable=SC1091  # the venv exists only on the cluster
    source "$VENV/bin/activate"
fi
exec "$@"
