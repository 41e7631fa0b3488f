#!/bin/sh
# Emulated hosts on one machine (docs/multihost.md): each host is a network namespace
# whose processes also get their own UTS namespace (hostname <prefix>-h<i>) and IPC
# namespace, so UCX sees a different host and uses no shared memory across hosts. Every
# host's eth0 is one end of a veth pair whose other end is a port of a bridge living in a
# namespace of its own (<prefix>-br); nothing is added to the caller's namespace. Host i
# is 10.77.0.<i+1>/24.
#
# Links are shaped at both ends of each veth (egress of the host's eth0 and of the
# bridge port: both directions): rate with tc tbf; loss with iptables' statistic match
# dropping packets at random in the host (INPUT and OUTPUT). There is no delay: this
# kernel has no netem, so latency is not emulated.
#
#   hosts.sh up PREFIX N [rate=R][,loss=P]   create N hosts (R: tc rate, e.g. 1gbit;
#                                            P: loss fraction, e.g. 0.01)
#   hosts.sh shape PREFIX I [rate=R][,loss=P]  reshape host I's link (empty: unshaped)
#   hosts.sh link PREFIX I up|down           bring host I's link up or take it down
#   hosts.sh exec PREFIX I CMD [ARG...]      run CMD inside host I (exec: replaces the shell)
#   hosts.sh addr PREFIX I                   print host I's address
#   hosts.sh down PREFIX                     kill every process in the hosts, delete them
#   hosts.sh clean                           delete the hosts of owners that are gone
#
# PREFIX: 2-8 of [a-z0-9], unique per user of the machine (tests: "fm" + their pid in
# base 36). `up` records its owner (FERRY_HOSTS_OWNER, default the caller's parent pid)
# under /run/ferry-hosts; `clean` (run by every `up`) deletes the hosts of any prefix
# whose owner is no longer alive, so a crashed run leaves nothing behind for long.
# Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2; loss needs iptables.
set -eu

STATE=/run/ferry-hosts

die() {
  echo "hosts.sh: $*" >&2
  exit 2
}

need_tools() {
  command -v ip >/dev/null 2>&1 || die "'ip' (iproute2) not found: apt-get install iproute2"
  command -v unshare >/dev/null 2>&1 || die "'unshare' (util-linux) not found"
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN); uid is $(id -u)"
}

check_prefix() {
  case "$1" in
    *[!a-z0-9]* | "") die "prefix '$1' must be 2-8 characters of [a-z0-9]" ;;
  esac
  [ ${#1} -ge 2 ] && [ ${#1} -le 8 ] || die "prefix '$1' must be 2-8 characters of [a-z0-9]"
}

# Namespaces are looked up as their files in /run/netns: `ip netns list` fails ("Peer
# netns reference is invalid") while any namespace on the machine is being deleted.
check_host() {
  [ -e "/run/netns/$1-h$2" ] || die "no host $2 under prefix '$1' (namespace $1-h$2 not found)"
}

# Parses "rate=R,loss=P" into RATE and LOSS.
parse_link() {
  local old_ifs kv
  RATE=""
  LOSS=""
  old_ifs=$IFS
  IFS=,
  for kv in $1; do
    case "$kv" in
      rate=*) RATE=${kv#rate=} ;;
      loss=*) LOSS=${kv#loss=} ;;
      "") ;;
      *) die "link option '$kv': expected rate=R (tc rate, e.g. 1gbit) or loss=P (fraction, e.g. 0.01)" ;;
    esac
  done
  IFS=$old_ifs
}

# tbf needs a bucket of at least one (GSO) packet; 1 ms of rate, at least 256 KiB, keeps
# the average exact and bursts short.
burst_of() {
  awk -v r="$1" 'BEGIN {
    n = r + 0; u = tolower(r); sub(/^[0-9.]+/, "", u)
    m = (u == "kbit") ? 1e3 : (u == "mbit") ? 1e6 : (u == "gbit") ? 1e9 : (u == "bit" || u == "") ? 1 : -1
    if (m < 0) exit 1
    b = n * m / 8 / 1000; if (b < 262144) b = 262144
    printf "%d", b }' || die "rate '$1': expected a number with bit, kbit, mbit or gbit (e.g. 1gbit)"
}

# Functions keep their variables local: `up` calls `clean`, which calls `down`.
shape() {
  local p=$1 i=$2 end b ns rule
  parse_link "$3"
  for end in "$p-h$i eth0" "$p-br h$i"; do
    set -- $end
    ip -n "$1" link show "$2" >/dev/null 2>&1 || die "shape: no device $2 in $1"
    tc -n "$1" qdisc del dev "$2" root 2>/dev/null || true
    if [ -n "$RATE" ]; then
      b=$(burst_of "$RATE")
      tc -n "$1" qdisc add dev "$2" root tbf rate "$RATE" burst "$b" latency 100ms ||
        die "shape: tc tbf rate $RATE on $2 in $1 failed"
    fi
  done
  ns=$p-h$i
  if [ -n "$LOSS" ] || ip netns exec "$ns" iptables -S 2>/dev/null | grep -q statistic; then
    command -v iptables >/dev/null 2>&1 || die "loss needs iptables: apt-get install iptables"
    ip netns exec "$ns" iptables -F INPUT
    ip netns exec "$ns" iptables -F OUTPUT
  fi
  if [ -n "$LOSS" ]; then
    for rule in "INPUT -i eth0" "OUTPUT -o eth0"; do
      ip netns exec "$ns" iptables -A $rule -m statistic --mode random --probability "$LOSS" -j DROP ||
        die "shape: iptables statistic drop $LOSS ($rule) in $ns failed"
    done
  fi
}

down() {
  local p=$1 ns pids
  for ns in $(ls /run/netns 2>/dev/null | grep "^$p-\(h[0-9]*\|br\)$" || true); do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -f "$STATE/$p" "$STATE/$p"-h*.pid
}

clean() {
  local f owner
  [ -d "$STATE" ] || return 0
  for f in "$STATE"/*; do
    [ -f "$f" ] || continue
    case "$f" in *.pid | *.tmp) continue ;; esac  # a host's namespace holder
    owner=$(cat "$f" 2>/dev/null || echo 0)
    if ! kill -0 "$owner" 2>/dev/null; then
      echo "hosts.sh: removing stale hosts '$(basename "$f")' (owner $owner is gone)" >&2
      down "$(basename "$f")"
    fi
  done
}

up() {
  local p=$1 n=$2 br i ns tries
  case "$n" in *[!0-9]* | "") die "host count '$n' is not a number" ;; esac
  [ "$n" -ge 1 ] && [ "$n" -le 200 ] || die "host count $n is outside 1..200"
  clean
  [ ! -e "$STATE/$p" ] || die "prefix '$p' is in use (owner $(cat "$STATE/$p")); pick another or run: hosts.sh down $p"
  mkdir -p "$STATE"
  # Recorded before anything exists, so that a crash half way is cleaned up too.
  echo "${FERRY_HOSTS_OWNER:-$PPID}" >"$STATE/$p"
  UP_PREFIX=$p
  trap 'down "$UP_PREFIX"' EXIT
  br=$p-br
  ip netns add "$br" || die "ip netns add $br failed (does this kernel allow network namespaces?)"
  ip -n "$br" link set lo up
  ip -n "$br" link add br0 type bridge
  ip -n "$br" link set br0 up
  i=0
  while [ "$i" -lt "$n" ]; do
    ns=$p-h$i
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip link add eth0 netns "$ns" type veth peer name "h$i" netns "$br"
    ip -n "$br" link set "h$i" master br0
    ip -n "$br" link set "h$i" up
    ip -n "$ns" addr add "10.77.0.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    [ -z "${3:-}" ] || shape "$p" "$i" "$3"
    # The host's UTS and IPC namespaces live as long as this holder process (which sits
    # in the host's network namespace, so `down` kills it with the rest): every process
    # run on the host joins them, so ranks on one host share memory and a hostname.
    ip netns exec "$ns" unshare --uts --ipc -- \
      sh -c 'hostname "$1" && echo $$ >"$2.tmp" && mv "$2.tmp" "$2" && exec sleep infinity' sh "$ns" "$STATE/$ns.pid" \
      </dev/null >/dev/null 2>&1 &
    i=$((i + 1))
  done
  i=0
  while [ "$i" -lt "$n" ]; do
    tries=0
    until [ -s "$STATE/$p-h$i.pid" ]; do
      tries=$((tries + 1))
      [ "$tries" -le 100 ] || die "host $i's namespace holder did not start within 10 s"
      sleep 0.1
    done
    i=$((i + 1))
  done
  trap - EXIT
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  up)
    [ $# -ge 2 ] || die "usage: hosts.sh up PREFIX N [rate=R][,loss=P]"
    need_tools
    check_prefix "$1"
    up "$@"
    ;;
  shape)
    [ $# -ge 2 ] || die "usage: hosts.sh shape PREFIX I [rate=R][,loss=P]"
    need_tools
    check_host "$1" "$2"
    shape "$1" "$2" "${3:-}"
    ;;
  link)
    [ $# -eq 3 ] || die "usage: hosts.sh link PREFIX I up|down"
    need_tools
    check_host "$1" "$2"
    case "$3" in up | down) ;; *) die "link state '$3': expected up or down" ;; esac
    ip -n "$1-br" link set "h$2" "$3"
    ;;
  exec)
    [ $# -ge 3 ] || die "usage: hosts.sh exec PREFIX I CMD [ARG...]"
    need_tools
    check_host "$1" "$2"
    holder=$(cat "$STATE/$1-h$2.pid" 2>/dev/null) || die "host $2 under prefix '$1' has no namespace holder"
    shift 2
    # The holder's network, UTS, IPC and mount namespaces (the mount one shows the host's
    # /sys/class/net); nsenter execs, so the command keeps this process's pid.
    exec nsenter -t "$holder" -n -u -i -m --wd="$PWD" -- "$@"
    ;;
  addr)
    [ $# -eq 2 ] || die "usage: hosts.sh addr PREFIX I"
    echo "10.77.0.$(($2 + 1))"
    ;;
  down)
    [ $# -eq 1 ] || die "usage: hosts.sh down PREFIX"
    need_tools
    check_prefix "$1"
    down "$1"
    ;;
  clean)
    need_tools
    clean
    ;;
  *) die "usage: hosts.sh up|shape|link|exec|addr|down|clean ... (see the top of this file)" ;;
esac
