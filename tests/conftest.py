import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:  # tiny models: one thread is as fast, and stays fast on a shared machine
    import torch

    torch.set_num_threads(1)
except ImportError:
    pass
