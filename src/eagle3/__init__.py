"""eagle3: EAGLE-3 speculative decoding for Hugging Face models.

Train a drafter for your model, decode losslessly (chain or tree), and export checkpoints that vLLM and
SGLang load. Start with `eagle3 --help` or README.md.
"""

from eagle3.config import ConfigError, DrafterConfig, DraftShape, SamplingConfig
from eagle3.drafter import Eagle3Drafter

__all__ = ["ConfigError", "DraftShape", "DrafterConfig", "Eagle3Drafter", "SamplingConfig"]
__version__ = "0.1.0"
