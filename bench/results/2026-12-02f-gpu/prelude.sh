# sourced first by every call: the wheels, liger-kernel apart in /tmp/liger, a cached extension build
source bench/results/2026-12-02d-gpu/prelude.sh
