# sourced first by every call: the wheels, liger-kernel apart in /tmp/liger, a cached extension build (the same
# file as the last session's, byte for byte, when these calls ran)
source bench/results/2026-12-02d-gpu/prelude.sh
