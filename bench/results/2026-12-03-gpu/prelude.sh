# sourced first by every call: the wheels, liger-kernel apart in /tmp/liger, a cached extension build if one came
# along (.ext/ext.tgz, call 1's builds)
source bench/results/2026-12-02d-gpu/prelude.sh
