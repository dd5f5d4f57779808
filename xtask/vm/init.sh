#!/bin/busybox sh
# The guest's init for `cargo xtask vm` (xtask/src/vm.rs builds it into the initramfs as /init).
#
# Stage 1, PID 1 in the initramfs: load the modules for 9p and overlayfs (listed in
# /modules.list, dependencies first), mount the host's root (9p tag "hostroot", read-only) as
# the lower layer of an overlay whose upper layer is a tmpfs (writes never reach the host),
# mount the kernel's own modules (9p tag "modules") over /lib/modules/<version>, the kernel's
# file systems, /run and /tmp (and, with observer.share=<path>, that host directory
# writable at the same path), and switch_root into the overlay. Not chroot: the kernel's
# module autoload runs /sbin/modprobe in init's root, which must be the host's.
#
# Stage 2, PID 1 in the new root (argument "stage2"): bring lo up, decode the command that the
# host put on the kernel command line (observer.run=<base64 of a shell script>), run it, print
# "OBSERVER-VM-EXIT <status>" on the console and power off.

if [ "$1" != stage2 ]; then
    B=/bin/busybox
else
    B=/run/observer-vm/busybox
fi

die() {
    echo "observer-vm: $*"
    $B poweroff -f
    echo o >/proc/sysrq-trigger
}

param() {
    for w in $($B cat /proc/cmdline); do
        case "$w" in "$1="*) echo "${w#*=}" ;; esac
    done
}

if [ "$1" != stage2 ]; then
    $B mount -t proc proc /proc
    $B mount -t sysfs sysfs /sys
    $B mount -t devtmpfs devtmpfs /dev
    for m in $($B cat /modules.list); do
        $B insmod "/modules/$m" || die "insmod $m failed"
    done
    v=$($B uname -r)
    $B mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000 hostroot /lower ||
        die "cannot mount the host's root (9p)"
    $B mount -t tmpfs -o mode=0755 tmpfs /rw
    $B mkdir -p /rw/upper /rw/work
    $B mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot ||
        die "cannot mount the overlay"
    $B mkdir -p "/newroot/lib/modules/$v"
    $B mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000 modules "/newroot/lib/modules/$v" ||
        die "cannot mount the modules (9p)"
    # A writable host directory at the same path (observer.share=<path>, 9p tag "share"):
    # what the guest's tests leave there for the host to read after the run.
    share=$(param observer.share)
    if [ -n "$share" ]; then
        $B mkdir -p "/newroot$share"
        $B mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 share "/newroot$share" ||
            die "cannot mount the shared directory $share (9p)"
    fi
    for d in dev proc sys run tmp; do $B mkdir -p "/newroot/$d"; done
    $B mount --move /dev /newroot/dev
    $B mount --move /proc /newroot/proc
    $B mount --move /sys /newroot/sys
    R=/newroot
    $B mkdir -p $R/dev/pts $R/dev/shm
    $B mount -t devpts -o newinstance,ptmxmode=0666,mode=0620 devpts $R/dev/pts
    $B mount -t tmpfs -o mode=1777 tmpfs $R/dev/shm
    $B ln -sf /proc/self/fd $R/dev/fd
    $B ln -sf /proc/self/fd/0 $R/dev/stdin
    $B ln -sf /proc/self/fd/1 $R/dev/stdout
    $B ln -sf /proc/self/fd/2 $R/dev/stderr
    $B mount -t bpf bpf $R/sys/fs/bpf
    $B mount -t debugfs debugfs $R/sys/kernel/debug
    $B mount -t tracefs tracefs $R/sys/kernel/tracing
    $B mount -t securityfs securityfs $R/sys/kernel/security
    $B mount -t cgroup2 cgroup2 $R/sys/fs/cgroup
    $B mount -t tmpfs -o mode=0755 tmpfs $R/run
    $B mount -t tmpfs -o mode=1777 tmpfs $R/tmp
    $B mkdir -p $R/run/observer-vm
    $B cp /bin/busybox /init $R/run/observer-vm/
    exec $B switch_root /newroot /run/observer-vm/busybox sh /run/observer-vm/init stage2
    die "switch_root failed"
fi

# Stage 2.
$B stty -F /dev/console -onlcr 2>/dev/null
$B ip link set lo up
$B hostname observer-vm
run=$(param observer.run)
[ -n "$run" ] || die "no observer.run= on the kernel command line"
echo "$run" | $B base64 -d >/run/observer-vm/command.sh || die "cannot decode observer.run"
# Only errors reach the console (loglevel=3); the whole kernel log follows the exit marker,
# for the host's log file only.
echo "OBSERVER-VM-START"
$B env -i HOME=/root TERM=dumb OBSERVER_VM_KERNEL="$($B uname -r)" \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    /bin/sh /run/observer-vm/command.sh </dev/null
echo "OBSERVER-VM-EXIT $?"
echo "--- dmesg ---"
$B dmesg
$B poweroff -f
echo o >/proc/sysrq-trigger
