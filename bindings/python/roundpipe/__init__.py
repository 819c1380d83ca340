"""RoundPipe for Python: upstream RoundPipe's API over the C library libroundpipe.

The engine (C++, libtorch) trains models with a round-robin pipeline of layer stages, fused
forward + backward with recompute, and an asynchronous CPU optimizer. This package is pure
Python: it reaches the library through ctypes and exchanges tensors with torch through DLPack,
without copies.

    import torch, roundpipe
    model = roundpipe.RoundPipe(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                                    torch.nn.Linear(32, 4)))
    opt = torch.optim.AdamW(model.optim_parameters(), lr=1e-3)
    def step_fn():
        opt.step()
        opt.zero_grad()
    for x, y in data:
        loss = model.forward_backward((x,), label=y,
                                      loss_fn=lambda out, y: torch.nn.functional.mse_loss(out, y))
        model.step(step_fn)
    model.synchronize()

Hugging Face Qwen3 / Qwen3-MoE / Llama causal LMs come in through wrap_model_to_roundpipe(transformers_model),
RoundPipe("path/to/hf_dir") or RoundPipe(config_dict), train with loss_fn="causal_lm" and save
with save_pretrained(dir) (see the README). LoRA adapters live in the engine too:
RoundPipe(model, lora=LoraConfig(...)), or a PEFT LoRA model (get_peft_model) of one of these
(docs/lora.md).

Several processes train one model together with ``RoundPipe(..., data_parallel=DataParallel())``
under torchrun: each runs its own pipeline on its share of the batch, the engine averages the
gradients (roundpipe.distributed, docs/several-machines.md).

The library is found through ROUNDPIPE_LIBRARY, next to the package, then the build tree of
a source checkout (see roundpipe._capi).

The library's log messages go to the logger ``logging.getLogger("roundpipe")`` (RP_LOG_LEVEL=
debug|info|warn|error sets its level and the library's); loading and saving weights draw tqdm
progress bars when tqdm is installed (set_progress_callback replaces them).
"""

from . import optim
from ._callbacks import set_log_callback, set_progress_callback
from ._capi import ABI_VERSION, candidate_paths, library_path, load_library
from .config import REPLICATE, RoundPipeRunConfig
from .execute_plan import ModelExecutePlan
from .timer import ModelTimer
from .errors import LibraryNotFoundError, RoundPipeError, RoundPipeUnsupportedError, Status
from .recompute import doing_recompute, get_recompute_data, save_for_recompute
from .context import OptimizerCtx
from .distributed import DataParallel, data_parallel_available
from .grad_scaler import GradScaler
from .lora import LoraConfig
from .model import BuiltinLoss, HostStateBytes, RoundPipe, RoundPipePackedData, spec_json
from .wrap import AutoRoundPipe, wrap_model_to_roundpipe

__version__ = "0.1.0"

LOG_DEBUG, LOG_INFO, LOG_WARN, LOG_ERROR = 0, 1, 2, 3


def library_version():
    """Version of the loaded libroundpipe ("MAJOR.MINOR.PATCH")."""
    from ._capi import lib
    return lib().rp_version().decode()


def cuda_device_count():
    """Number of CUDA GPUs the library sees (0 without a GPU or a CUDA build)."""
    import ctypes

    from ._capi import lib
    count = ctypes.c_int32()
    lib().rp_cuda_device_count(ctypes.byref(count))
    return count.value


__all__ = [
    "RoundPipe", "RoundPipeRunConfig", "RoundPipeError", "RoundPipeUnsupportedError",
    "LibraryNotFoundError", "Status", "BuiltinLoss", "RoundPipePackedData", "REPLICATE",
    "wrap_model_to_roundpipe", "optim", "set_log_callback", "set_progress_callback",
    "load_library", "library_path",
    "library_version", "cuda_device_count", "candidate_paths", "spec_json", "ABI_VERSION",
    "HostStateBytes", "doing_recompute", "save_for_recompute", "get_recompute_data",
    "AutoRoundPipe", "GradScaler", "OptimizerCtx", "ModelExecutePlan", "ModelTimer",
    "DataParallel", "data_parallel_available", "LoraConfig",
]
