#!/bin/sh
# A directory on a disk that writes at BYTES_PER_S (default 100 MB/s): an ext4 loop device under
# a blkio write throttle (cgroup v1 root group, so writeback and fsync are throttled too).
# Needs root. Usage: sudo benchmarks/slow_disk.sh /mnt/slow [BYTES_PER_S] [SIZE]
set -e
DIR=${1:-/mnt/slow}
BPS=${2:-100000000}
SIZE=${3:-4G}
IMG=/tmp/zeroengine_slow_disk.img
truncate -s "$SIZE" "$IMG"
LOOP=$(losetup -f --show "$IMG")
mkfs.ext4 -q "$LOOP"
mkdir -p "$DIR"
mount "$LOOP" "$DIR"
# major:minor in decimal (stat prints them in hex; shell arithmetic, not gawk's strtonum)
DEV="$(( 0x$(stat -c '%t' "$LOOP") )):$(( 0x$(stat -c '%T' "$LOOP") ))"
if [ -w /sys/fs/cgroup/blkio/blkio.throttle.write_bps_device ]; then
    echo "$DEV $BPS" > /sys/fs/cgroup/blkio/blkio.throttle.write_bps_device
else  # cgroup v2
    echo "$DEV wbps=$BPS" > /sys/fs/cgroup/io.max
fi
echo "$DIR on $LOOP ($DEV), writes throttled to $BPS bytes/s"
