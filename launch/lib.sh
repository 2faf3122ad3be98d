# shellcheck shell=bash
# Helpers shared by the launch scripts: phase logging, the job's host list, printing or running a command.

# One line per phase on stderr, with wall-clock time and seconds since the script started.
log_phase() {
    printf '[mcore-rl][%s][+%ss] %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$SECONDS" "$*" >&2
}

die() {
    log_phase "ERROR: $*"
    exit 1
}

# -h / --help as a script's first argument: its header comment (the usage, examples and environment it
# reads), then exit 0. Called before any other argument is read, so help never starts a run.
help_on_request() {
    local script=$1
    shift
    case ${1:-} in
        -h | --help)
            sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$script"
            exit 0
            ;;
    esac
}

# A command as one line a shell reads back into the same words (printf %q), for dry runs and logs.
quote_cmd() {
    local out
    printf -v out '%q ' "$@"
    printf '%s\n' "${out% }"
}

# The job's hosts, one per line, in Slurm's order. Real jobs ask scontrol; a dry run on a machine without
# Slurm expands SLURM_JOB_NODELIST itself (prefix[01-04,07] forms), so the templates run anywhere.
job_hostnames() {
    local nodelist=${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set: run inside an allocation or with DRY_RUN=1}
    if command -v scontrol >/dev/null 2>&1; then
        scontrol show hostnames "$nodelist"
    elif [[ ${DRY_RUN:-0} == 1 ]]; then
        expand_nodelist "$nodelist"
    else
        die "scontrol not found: cannot expand SLURM_JOB_NODELIST=$nodelist"
    fi
}

# Slurm's compressed host list -> one host per line (one bracket group per item; enough for dry runs).
expand_nodelist() {
    local list=$1 cur="" ch item prefix suffix range lo hi n i depth=0
    local -a items=() ranges=()
    for ((i = 0; i < ${#list}; i++)); do
        ch=${list:i:1}
        case $ch in
            '[') depth=$((depth + 1)) && cur+=$ch ;;
            ']') depth=$((depth - 1)) && cur+=$ch ;;
            ',') if ((depth)); then cur+=$ch; else items+=("$cur") && cur=""; fi ;;
            *) cur+=$ch ;;
        esac
    done
    items+=("$cur")
    for item in "${items[@]}"; do
        if [[ $item =~ ^([^[]*)\[([^]]*)\](.*)$ ]]; then
            prefix=${BASH_REMATCH[1]}
            suffix=${BASH_REMATCH[3]}
            IFS=, read -r -a ranges <<<"${BASH_REMATCH[2]}"
            for range in "${ranges[@]}"; do
                if [[ $range == *-* ]]; then
                    lo=${range%-*}
                    hi=${range#*-}
                    for ((n = 10#$lo; n <= 10#$hi; n++)); do
                        printf '%s%0*d%s\n' "$prefix" "${#lo}" "$n" "$suffix"
                    done
                else
                    printf '%s%s%s\n' "$prefix" "$range" "$suffix"
                fi
            done
        else
            printf '%s\n' "$item"
        fi
    done
}

# First IPv4 address of a host (Ray wants an address, not a name that may resolve differently per node).
resolve_ipv4() {
    local host=$1 address
    address=$(getent ahostsv4 "$host" 2>/dev/null | awk 'NR == 1 { print $1 }')
    if [[ -z $address ]]; then
        [[ ${DRY_RUN:-0} == 1 ]] || die "cannot resolve an IPv4 address for $host; set HEAD_IP"
        address=$host
    fi
    printf '%s\n' "$address"
}
