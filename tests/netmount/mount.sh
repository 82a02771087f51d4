#!/usr/bin/env bash
# Mount a FUSE network filesystem over loopback: sshfs, through a throwaway sshd on
# 127.0.0.1, of a fresh directory. The test mode `ORCH_TEST_NETMOUNT=cache|nocache` and
# `bench/system_netmount.py` use it; `umount.sh` takes it down again.
#
#   tests/netmount/mount.sh cache|nocache
#
# cache    sshfs's defaults: its directory cache (names, attributes, links) for 20 s,
#          the kernel's entry and attribute caches for 1 s: what a plain
#          `sshfs host:dir mnt` gives.
# nocache  no caching: `dir_cache=no`, and the kernel's entry, attribute and negative
#          entry timeouts at 0, so every lookup and stat goes to the server.
#
# Prints the mount point, `<state>/mnt`, on the last line of stdout. The server's side of
# it, where another host would write, is `<state>/export`. Everything else (keys, the
# sshd config, its pid and log) is in `<state>` too, and only there.
#
# Installs sshfs and openssh-server from the Debian packages when they are missing (root
# only). Exits 2 with one line on stderr saying why, and leaves nothing behind, when no
# mount can be made here (not root, no /dev/fuse, no package, sshd or sshfs failing).
set -euo pipefail

mode="${1:-}"
case "$mode" in
cache) options=() ;;
nocache) options=(-o dir_cache=no,entry_timeout=0,attr_timeout=0,negative_timeout=0) ;;
*)
    echo "usage: $0 cache|nocache" >&2
    exit 64
    ;;
esac

fail() {
    echo "cannot mount sshfs over loopback: $*" >&2
    exit 2
}

[[ "$(id -u)" == 0 ]] || fail "needs root (FUSE mounts, a throwaway sshd, package installs)"
[[ -c /dev/fuse && -r /dev/fuse && -w /dev/fuse ]] || fail "no usable /dev/fuse"

sshd=/usr/sbin/sshd
if ! command -v sshfs >/dev/null 2>&1 || [[ ! -x "$sshd" ]]; then
    command -v apt-get >/dev/null 2>&1 || fail "sshfs or sshd missing and no apt-get"
    # Installing openssh-server may try to start the system's sshd; on the machines this
    # runs on policy-rc.d refuses that, and ours never uses it anyway.
    log=$(mktemp)
    if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -q sshfs openssh-server \
        || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
            sshfs openssh-server; }; } >"$log" 2>&1; then
        reason=$(tail -n 1 "$log")
        rm -f "$log"
        fail "apt-get install sshfs openssh-server failed: $reason"
    fi
    rm -f "$log"
fi
command -v ssh-keygen >/dev/null 2>&1 || fail "no ssh-keygen"

state=$(mktemp -d /tmp/orch-netmount.XXXXXX)
cleanup_on_failure() {
    if [[ -f "$state/sshd.pid" ]]; then
        kill "$(cat "$state/sshd.pid")" 2>/dev/null || true
    fi
    rm -rf "$state"
}
trap cleanup_on_failure ERR

mkdir -p "$state/export" "$state/mnt"
ssh-keygen -q -t ed25519 -N '' -C orch-netmount-host -f "$state/host_key"
ssh-keygen -q -t ed25519 -N '' -C orch-netmount-client -f "$state/client_key"
cp "$state/client_key.pub" "$state/authorized_keys"
chmod 600 "$state/authorized_keys"
# sshd refuses to start without its privilege separation directory.
mkdir -p /run/sshd
chmod 755 /run/sshd

start_sshd() {
    local port
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    cat >"$state/sshd_config" <<EOF
Port $port
ListenAddress 127.0.0.1
HostKey $state/host_key
PidFile $state/sshd.pid
AuthorizedKeysFile $state/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
X11Forwarding no
AllowTcpForwarding no
PrintMotd no
Subsystem sftp /usr/lib/openssh/sftp-server
EOF
    rm -f "$state/sshd.pid"
    "$sshd" -f "$state/sshd_config" -E "$state/sshd.log" || return 1
    # sshd writes its pid file once it listens.
    for _ in $(seq 50); do
        [[ -s "$state/sshd.pid" ]] && { echo "$port"; return 0; }
        sleep 0.1
    done
    return 1
}

# The free port is picked, then bound by sshd: another process may take it in between.
port=""
for _ in 1 2 3; do
    if port=$(start_sshd); then break; fi
    port=""
done
if [[ -z "$port" ]]; then
    reason=$(tail -n 1 "$state/sshd.log" 2>/dev/null || true)
    cleanup_on_failure
    trap - ERR
    fail "sshd did not start: ${reason:-no log}"
fi

if ! sshfs "root@127.0.0.1:$state/export" "$state/mnt" \
    -o "Port=$port,IdentityFile=$state/client_key,IdentitiesOnly=yes" \
    -o "UserKnownHostsFile=/dev/null,StrictHostKeyChecking=no,BatchMode=yes,LogLevel=ERROR" \
    "${options[@]}" 2>"$state/sshfs.log"; then
    reason=$(tail -n 1 "$state/sshfs.log" 2>/dev/null || true)
    cleanup_on_failure
    trap - ERR
    fail "sshfs failed: ${reason:-no message}"
fi
trap - ERR
echo "$mode" >"$state/mode"
echo "$state/mnt"
