"""rlctl: resumable GRPO/PPO fine-tuning of language models on DeepSpeed ZeRO."""

import os as _os

__version__ = "0.1.0"

# torch >= 2.5 imports every installed device plugin (torch_npu) on `import torch`; rlctl imports
# torch_npu only when an NPU is asked for or found (rlctl.engine.runtime).
_os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
