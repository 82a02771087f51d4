#!/usr/bin/env bash
# Take down a mount made by `mount.sh`: unmount it, stop its sshd, remove its directory.
#
#   tests/netmount/umount.sh MOUNT_POINT
#
# MOUNT_POINT is what mount.sh printed (`<state>/mnt`). Only a directory mount.sh made is
# touched: one named /tmp/orch-netmount.* holding its sshd config.
set -euo pipefail

mnt="${1:-}"
[[ -n "$mnt" ]] || {
    echo "usage: $0 MOUNT_POINT" >&2
    exit 64
}
state=$(dirname "$mnt")
if [[ ! "$state" =~ ^/tmp/orch-netmount\.[A-Za-z0-9_]+$ || "$(basename "$mnt")" != mnt ]]; then
    echo "$0: $mnt is not a mount point made by mount.sh" >&2
    exit 64
fi
[[ -f "$state/sshd_config" ]] || {
    echo "$0: $state holds no sshd_config: not made by mount.sh" >&2
    exit 64
}

if mountpoint -q "$mnt"; then
    # Busy (a descriptor still open): detach it now, freed when released.
    fusermount3 -u "$mnt" 2>/dev/null || fusermount3 -u -z "$mnt" || umount -l "$mnt"
fi
if [[ -s "$state/sshd.pid" ]]; then
    kill "$(cat "$state/sshd.pid")" 2>/dev/null || true
fi
# Nothing is mounted there any more: this removes our files, never the server's others.
if mountpoint -q "$mnt"; then
    echo "$0: $mnt is still mounted; left $state in place" >&2
    exit 1
fi
rm -rf "$state"
