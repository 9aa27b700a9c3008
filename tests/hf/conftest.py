"""tests/hf: Hugging Face transformers (CPU, float64 references) as the
oracle of `moestash`'s Qwen3-MoE. $MST_MOESTASH names the program (CTest's
hf_oracle sets it). oracle.py holds the shared pieces."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
