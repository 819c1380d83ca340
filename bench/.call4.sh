S=$SECONDS
OUT=$OUT/a AB_STOP_AFTER=300 AB_VARIANTS="auto base:plan=5,5,5,5,5,5,5,4 lead3:plan=3,3,6,6,6,5,5,5 auto2 base2:plan=5,5,5,5,5,5,5,4" AB_ARGS="--host-memory saving --pin register --step-in-call on --warmup 2 --steps 3 --opt-steps 2" bash bench/run_env_ab.sh 2>&1 | tee $OUT/ab8b.txt
grep -h "stages\|re-plan\|replan" $OUT/a/env-ab/*/*.log 2>/dev/null | head; 
if [ $((SECONDS - S)) -lt 420 ]; then
OUT=$OUT/r1 AB_SHAPE=qwen3-1.7b AB_GPUS=1 AB_VARIANTS="one" AB_ARGS="--microbatches 4 --plan 15,16 --warmup 3 --steps 4" bash bench/run_env_ab.sh 2>&1 | tee $OUT/ratio.txt
OUT=$OUT/r2 AB_SHAPE=qwen3-1.7b AB_GPUS=2 AB_VARIANTS="two" AB_ARGS="--microbatches 4 --plan 2,4,14,11 --warmup 3 --steps 4" bash bench/run_env_ab.sh 2>&1 | tee -a $OUT/ratio.txt
fi
echo "total $((SECONDS - S)) s"
