"""fusedopt: memory-lean drop-in torch.optim optimizers.

Compressed optimizer state, master-weight splitting, one fused Triton kernel per parameter
and gradient release during backward; ``chunked_cross_entropy``, an LM loss that never builds the
full logits; ``split_rows``, which holds an embedding or LM head as row pieces so that release
holds one piece's gradient at a time; ``reset_fsdp_backward_state``, FSDP2's recovery from a failed
backward. ``fusedopt.kernels`` is internal.
"""

from .adafactor import Adafactor
from .adamw import AdamW
from .lion import Lion
from .losses import chunked_cross_entropy
from .optimizer import FusedOptimizer
from .pieces import split_rows
from .sgd import SGD
from .sharding import reset_fsdp_backward_state
from .weights import load_master_state_dict, master_state_dict

__version__ = "0.1.0"
__all__ = [
    "AdamW",
    "SGD",
    "Lion",
    "Adafactor",
    "chunked_cross_entropy",
    "split_rows",
    "FusedOptimizer",
    "master_state_dict",
    "load_master_state_dict",
    "reset_fsdp_backward_state",
    "__version__",
]
