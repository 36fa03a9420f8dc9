#!/usr/bin/env bash
# A throwaway Slurm cluster on this host, for tests: munged + slurmctld + 4 slurmd (virtual
# nodes n0..n3 on localhost, 2 CPUs each, no GPUs, cgroups off), all state under DIR.
#   bash scripts/slurm_cluster.sh start DIR    # waits until the 4 nodes are idle; DIR/env
#   source DIR/env; sbatch ...; squeue
#   bash scripts/slurm_cluster.sh stop DIR     # stops them by the pids they recorded
# Needs root, slurm-wlm and munge (scripts/setup.sh installs them where it may). Ports: a
# random block in 16000-20999. Used by tests/deploy/test_slurm.py.
set -euo pipefail
cmd=${1:?start|stop}; dir=$(realpath -m "${2:?state directory}")
case $cmd in
start)
    mkdir -p "$dir"/{munge,spool,state,log}
    chmod 700 "$dir/munge"
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$dir/munge/munge.key"
    /usr/sbin/munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/socket" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" \
        --seed-file="$dir/munge/seed"
    cat > "$dir/slurm.conf" <<CONF
ClusterName=looprltest
SlurmctldHost=localhost
SlurmctldPort=$(( 17000 + RANDOM % 1000 ))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core

MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
# a test cluster: schedule a batch job at submit (the default may wait 3 s)
SchedulerParameters=batch_sched_delay=0
NodeName=n0 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$(( 18000 + RANDOM % 1000 )) CPUs=2 State=UNKNOWN
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$(( 19000 + RANDOM % 1000 )) CPUs=2 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$(( 20000 + RANDOM % 1000 )) CPUs=2 State=UNKNOWN
NodeName=n3 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$(( 16000 + RANDOM % 1000 )) CPUs=2 State=UNKNOWN
PartitionName=cpu Nodes=n[0-3] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
    export SLURM_CONF=$dir/slurm.conf
    /usr/sbin/slurmctld -f "$dir/slurm.conf" -i
    for n in n0 n1 n2 n3; do mkdir -p "$dir/spool/$n"; /usr/sbin/slurmd -f "$dir/slurm.conf" -N $n; done
    echo "export SLURM_CONF=$dir/slurm.conf" > "$dir/env"
    for _ in $(seq 60); do  # the nodes register within a few seconds
        if [[ $(sinfo -h -o %t | sort -u) == idle ]]; then exit 0; fi
        sleep 0.5
    done
    echo "slurm_cluster.sh: the nodes did not come up; see $dir/log" >&2
    sinfo >&2 || true
    exit 1
    ;;
stop)
    for f in "$dir"/slurmd-*.pid "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
        [[ -f $f ]] && kill "$(cat "$f")" 2> /dev/null || true
    done
    for f in "$dir"/slurmd-*.pid "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
        for _ in $(seq 40); do
            [[ -f $f ]] && kill -0 "$(cat "$f")" 2> /dev/null || break
            sleep 0.25
        done
    done
    ;;
esac
