# bench_serving with the lane gate as it was before session 15 (no probe_share bound)
import runpy, sys
from eagle3.serving.policy import SpecPolicy, SpeedGate
SpecPolicy.lane_gate = lambda self: SpeedGate(probe_every=4, ema=self.ema, max_probe_every=64)
sys.argv = ["bench_serving.py"] + sys.argv[1:]
runpy.run_path("scripts/bench_serving.py", run_name="__main__")
