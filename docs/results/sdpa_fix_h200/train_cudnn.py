"""`eagle3 train` with cuDNN SDPA left in (the behaviour before the fix), for an A/B on the same machine."""
import contextlib, sys
import eagle3.training.trainer as tr
from eagle3.cli import main
tr.varying_shape_attention = lambda device: contextlib.nullcontext()
sys.exit(main(sys.argv[1:]))
