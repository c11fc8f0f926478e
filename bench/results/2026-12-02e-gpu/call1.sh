# the GPU lane on the final code, liger-kernel on the path (its equality test runs); then the LM head + loss alone
# (the model's own loss, Liger's, the chunked one) at llama-7b's 16 x 511 tokens and at Llama-3.1-8B's vocabulary
D=bench/results/2026-12-02e-gpu; source $D/prelude.sh
export PYTHONPATH=/tmp/liger:$PYTHONPATH
W=/tmp/o1; mkdir -p $W/lane $W/loss
FITONE_GPU_LANE_OUT=$W/lane timeout -s KILL 470 python3 -m pytest -m gpu -v --durations=0 -p no:cacheprovider tests/gpu > $W/lane/gpu-lane.log 2>&1
echo "exit $?" >> $W/lane/gpu-lane.log
tar czf $OUT/call1.tgz -C $W .
timeout -s KILL 70 python3 scripts/bench_loss.py --tokens 8176 --hidden 4096 --vocab 32000,128256 --out $W/loss > $W/loss/bench-loss.log 2>&1
echo "exit $?" >> $W/loss/bench-loss.log
tar czf $OUT/call1.tgz -C $W .
tar czf $OUT/ext.tgz -C /tmp ext  # the builds this machine made (cpu_adam, shm_comm, fitone's ops), for the next calls
