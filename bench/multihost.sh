#!/bin/sh
# A sync against the speed of light of emulated hosts (docs/RESULTS.md, "Several hosts on
# one machine"): `ferry demo --hosts H --link rate=R` for H in $HOSTS, R in $RATES, pull
# and push. Each prints, per sync, every host's bytes in and out, the sync's seconds, the
# speed of light (max over hosts of bytes in or out / link rate) and their ratio. Needs
# root. Sizes: the demo's dense model (Llama-3.1-8B shrunk: 4 layers, hidden 1024), trainer
# tp=2, inference tp=2 x 2 replicas: 374 MB per sync. OVERRIDES (JSON merged into the shrunk
# config, e.g. '{"num_hidden_layers":16}' for a larger model) and INFERENCE change that;
# BYTES is then what the MPI_Bcast baseline sends (the checkpoint's bytes: the demo prints
# them).
#
#   FERRY=build/src/cli/ferry HOSTS="2 4" RATES="1gbit 10gbit" MODES="pull push" bench/multihost.sh
#   RELAY=1 HOSTS=2 RATES=1gbit bench/multihost.sh   # both replicas on the inference host, relayed
set -eu
FERRY=${FERRY:-build/src/cli/ferry}
HOSTS=${HOSTS:-2 4}
RATES=${RATES:-1gbit 10gbit}
MODES=${MODES-pull push}  # MODES="": the MPI_Bcast baseline only
SYNCS=${SYNCS:-3}
OVERRIDES=${OVERRIDES:-}
INFERENCE=${INFERENCE:-tp=2,replicas=2}
RELAY=${RELAY:-}  # RELAY=1: --relay (replicas on one host copy from one; docs/relay.md)
ORDERS=${ORDERS:-rotated}  # --group-order of each run (the default: rotated)
DEMO_ARGS=${DEMO_ARGS:-}  # more ferry demo options, e.g. "--rank-timeout-ms 120000 --stall-ms 120000" for slow links
BYTES=${BYTES:-187207680}
NINF=${NINF:-4}  # inference ranks (the broadcast's receivers), spread as ferry's over the inference hosts
for h in $HOSTS; do
  for r in $RATES; do
    for m in $MODES; do
      for o in $ORDERS; do
        echo "=== hosts $h, link rate=$r, mode $m, order $o${RELAY:+, relay}"
        "$FERRY" demo --hosts "$h" --link "rate=$r" --mode "$m" --group-order "$o" ${RELAY:+--relay} --kill-sync 0 \
          --syncs "$SYNCS" --model configs/llama-3.1-8b.json ${OVERRIDES:+--config-overrides "$OVERRIDES"} \
          --trainer "${TRAINER:-tp=2}" --inference "$INFERENCE" $DEMO_ARGS 2>&1 |
          grep -E '^ +(version|[0-9]+ +[0-9]+ )|FAILED|verified bit'
      done
    done
  done
done

# MPI_Bcast of the checkpoint's bytes (187207680: what a broadcast design sends every
# inference rank) from a root on host 0 to the 4 inference ranks, placed as ferry's are,
# over OpenMPI's tcp btl on the hosts' eth0. mpirun runs inside host 0 with PMIx remote
# connections on: its ranks in other network namespaces cannot reach its loopback.
[ "${MPI:-1}" = 1 ] || exit 0
command -v mpicxx >/dev/null 2>&1 || { echo "no mpicxx: MPI_Bcast baseline skipped"; exit 0; }
BIN=$(mktemp -d)/multihost_mpi_bcast
mpicxx -O2 -o "$BIN" "$(dirname "$0")/multihost_mpi_bcast.cpp"
S="$(dirname "$0")/../scripts/hosts.sh"
P=mb$(($$ % 100000))  # prefixes are at most 8 characters
for h in $HOSTS; do
  for r in $RATES; do
    echo "=== MPI_Bcast, hosts $h, link rate=$r"
    FERRY_HOSTS_OWNER=$$ "$S" up "$P" "$h" "rate=$r"
    run="$BIN $BYTES 3"
    if [ "$h" = 2 ]; then
      places="-np 1 $S exec $P 0 $run : -np $NINF $S exec $P 1 $run"
    else
      places="-np 1 $S exec $P 0 $run : -np $((NINF / 2)) $S exec $P 2 $run : -np $((NINF - NINF / 2)) $S exec $P 3 $run"
    fi
    "$S" exec "$P" 0 env PMIX_MCA_ptl_tcp_remote_connections=1 PMIX_MCA_ptl_tcp_if_include=eth0 \
      mpirun --allow-run-as-root --oversubscribe --mca pml ob1 --mca btl self,tcp --mca btl_tcp_if_include eth0 \
      --mca oob_tcp_if_include eth0 $places 2>&1 | grep mpi_bcast || true
    "$S" down "$P"
  done
done
