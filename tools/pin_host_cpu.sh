#!/usr/bin/env bash
# Makes every Python process that starts with a site-packages directory compile the
# host side of MAX's kernels for one named LLVM CPU (max.driver.set_virtual_cpu_target)
# instead of the machine's own processor, which enters the key of MAX's kernel cache:
# so the GPU proof (tools/gpu_proof.sh) finds the kernels tools/gpu_warm_cache.sh
# compiled on another machine for that CPU. A .pth line, as the checkout's venv points
# its cache (Makefile): it runs at start-up, before the process compiles anything, and
# does nothing in a process that cannot import MAX.
#
# Usage: tools/pin_host_cpu.sh SITE_PACKAGES CPU    (CPU empty: remove the pin)
set -euo pipefail
site=$1 cpu=$2
pin=$site/mokv_host_cpu.pth
if [ -z "$cpu" ]; then
    rm -f "$pin"
    exit 0
fi
case $cpu in
    *[!A-Za-z0-9._-]*) echo "pin_host_cpu.sh: not an LLVM CPU name: '$cpu'" >&2; exit 2 ;;
esac
echo "import importlib.util; importlib.util.find_spec('max') and __import__('max.driver').driver.set_virtual_cpu_target('$cpu')" > "$pin"
